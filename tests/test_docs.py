"""The README and docs/ stay true: their links resolve, every setting is documented, and the
README's example request, run as written against a live gateway, gives the answer it shows."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

from service.settings import Settings
from service.settings.reference import reference
from tests.conftest import running_gateway

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "performance").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_settings_page_is_made_from_the_settings() -> None:
    """docs/settings.md's table is what ``gateway settings`` prints from the fields' docstrings:
    a setting added, renamed or redescribed without regenerating the page fails here."""
    documented = (ROOT / "docs" / "settings.md").read_text()
    table = "".join(line + "\n" for line in documented.splitlines() if line.startswith("|"))
    assert table == reference(), "docs/settings.md is out of date: regenerate its table with `gateway settings`"
    assert all(f"`GATEWAY_{name.upper()}`" in table for name in Settings.model_fields)


def test_the_readmes_example_request_gives_the_answer_it_shows(
    gateway_factory: Callable[..., Settings], cat_jpeg: bytes, tmp_path: Path
) -> None:
    text = (ROOT / "README.md").read_text()
    example = re.search(r"```sh\n(curl [^\n]+)\n((?:# [^\n]*\n)+)```", text)
    assert example, "the README's example request is gone"
    command, shown = example.group(1), example.group(2)
    expected = re.search(r'"label":"([^"]+)"', shown)
    assert expected, shown
    (tmp_path / "cat.jpg").write_bytes(cat_jpeg)

    async def run() -> dict[str, object]:
        async with running_gateway(gateway_factory()) as client:
            port = client.base_url.port
            argv = [arg.replace("localhost:8000", f"127.0.0.1:{port}") for arg in shlex.split(command)]
            curl = await asyncio.create_subprocess_exec(*argv, cwd=tmp_path, stdout=asyncio.subprocess.PIPE)
            out, _ = await curl.communicate()
            assert curl.returncode == 0
            return dict(json.loads(out))

    answer = asyncio.run(run())
    results = answer["results"]
    assert isinstance(results, list)
    assert results[0]["filename"] == "cat.jpg"
    assert results[0]["labels"][0]["label"] == expected.group(1), answer
    model = re.search(r'"model":(\{[^}]*\})', shown)
    assert model, shown
    assert answer["model"] == json.loads(model.group(1))
