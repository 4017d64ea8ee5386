"""The README and docs/ stay true: their links resolve, every setting is documented, and the
README's example request, run as written against a live gateway, gives the answer it shows."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    gateway_factory: Callable[..., Settings], cat_jpeg: bytes
) -> None:
    text = (ROOT / "README.md").read_text()
    example = re.search(r"```sh\n(curl [^\n]+)\n((?:# [^\n]*\n)+)```", text)
    assert example, "the README's example request is gone"
    command, shown = example.group(1), example.group(2)
    expected = re.search(r'"label":"([^"]+)"', shown)
    assert expected, shown
    assert (ROOT / "examples" / "cat.jpg").read_bytes() == cat_jpeg  # the photo it names is shipped

    async def run() -> dict[str, object]:
        async with running_gateway(gateway_factory()) as client:
            port = client.base_url.port
            argv = [arg.replace("localhost:8000", f"127.0.0.1:{port}") for arg in shlex.split(command)]
            curl = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
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


def test_the_study_is_summarised_in_the_repository_and_cited_there() -> None:
    """The study the benchmarks reproduce has its page in docs/, and nothing cites a file the
    repository does not hold (a PAPER.md beside a developer's checkout is not shipped)."""
    assert (ROOT / "docs" / "study.md").exists()
    assert "(docs/study.md)" in (ROOT / "README.md").read_text()
    citing = [
        path.relative_to(ROOT)
        for folder in ("service", "loadtests", "docs", "examples", "deploy")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".md", ".sh", ".yml", ".yaml"} and "PAPER.md" in path.read_text(errors="replace")
    ]
    assert not citing, citing
    assert "PAPER.md" not in (ROOT / "README.md").read_text()


async def test_an_offline_submit_without_a_broker_gets_what_the_settings_page_says(
    gateway_factory: Callable[..., Settings],
) -> None:
    from service.backends.fake import FakeBackend
    from tests.conftest import png_bytes, solid_image

    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        r = await client.post(
            "/classify",
            params={"mode": "offline"},
            content=png_bytes(solid_image(1, 16)),
            headers={"content-type": "image/png"},
        )
    assert r.status_code == 400
    assert r.json()["error"] == "bad_request"
    assert "GATEWAY_BROKER_URL" in r.json()["detail"]
    row = next(
        line for line in (ROOT / "docs" / "settings.md").read_text().splitlines() if "`GATEWAY_BROKER_URL`" in line
    )
    assert "get 400 (`bad_request`" in row
    assert "503" not in row


def test_the_inference_protocols_curl_example_runs_as_written(
    gateway_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    """docs/api.md's Open Inference Protocol example, its shell lines run as written (the body built
    in a file: a photo's base64 on the command line fails from ~96 KB), gives the answer shown."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"```sh\n(\{ printf .*?/v2/models/efficientnet-lite0/infer\n)((?:# [^\n]*\n)+)", text, re.S)
    assert block, "docs/api.md's /v2 curl example is gone"
    script, shown = block.group(1), "".join(line[2:] for line in block.group(2).splitlines(keepends=True))
    (tmp_path / "examples").mkdir()
    big = ROOT / "examples" / "coffee.jpg"  # over 96 KB: the size that failed as an argument
    assert big.stat().st_size > 96 * 1024
    (tmp_path / "examples" / "cat.jpg").write_bytes((ROOT / "examples" / "cat.jpg").read_bytes())

    async def run(photo: str) -> dict[str, object]:
        async with running_gateway(gateway_factory()) as client:
            port = client.base_url.port
            command = script.replace("localhost:8000", f"127.0.0.1:{port}").replace("examples/cat.jpg", photo)
            shell = await asyncio.create_subprocess_exec(
                "sh", "-c", command, cwd=tmp_path, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await shell.communicate()
            assert shell.returncode == 0
            return dict(json.loads(out))

    assert asyncio.run(run("examples/cat.jpg")) == json.loads(shown)
    coffee = asyncio.run(run(str(big)))
    assert coffee["model_name"] == "efficientnet-lite0"


def test_the_offline_pages_diagram_names_the_queues_the_workers_consume() -> None:
    """docs/offline.md's diagram sends jobs to the queue ``service.jobs.topology`` declares and the
    workers consume (``<prefix>.work``, and ``.work.<model>``), not to one named after the exchange;
    and the page gives ``timings``' unit, the one the worker measures in."""
    from service.jobs.topology import Names

    page = (ROOT / "docs" / "offline.md").read_text()
    diagram = page.split("```")[3]  # the second fenced block: the diagram
    names = Names("p")
    assert names.work == "p.work"
    assert names.requests == "p.requests"
    assert "<p>.requests exchange --> <p>.work queue" in diagram
    assert "<p>.work.<model>" in diagram
    assert "<p>.requests queue" not in diagram
    assert "**`timings`** of a result are in seconds" in page


def test_the_openapi_description_holds_the_inference_protocol_and_docs_need_no_internet(
    gateway_factory: Callable[..., Settings],
) -> None:
    """/openapi.json describes the /v2 routes too (with the protocol's error shape), and /docs loads
    Swagger UI from the gateway itself, not from a CDN: it works on a machine without internet."""
    from service.backends.fake import FakeBackend

    async def fetch() -> tuple[dict[str, Any], str, list[int]]:
        async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
            schema = (await client.get("/openapi.json")).json()
            page = (await client.get("/docs")).text + (await client.get("/redoc")).text
            assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page)
            statuses = [(await client.get(asset)).status_code for asset in assets if asset.startswith("/")]
            return schema, page, statuses

    schema, page, statuses = asyncio.run(fetch())
    infer = schema["paths"]["/v2/models/{name}/infer"]["post"]
    assert "inputs" in infer["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert infer["responses"]["400"]["content"]["application/json"]["schema"]["required"] == ["error"]
    assert {"/v2", "/v2/health/ready", "/v2/models/{name}/versions/{version}/infer"} <= set(schema["paths"])
    # each route with the answers it can give (a 422 only for a query parameter, in the protocol's
    # shape, not FastAPI's validation error), readiness with its body
    assert infer["parameters"][-1]["name"] == "Inference-Header-Content-Length"
    assert {"400", "413", "422", "429", "503"} <= set(infer["responses"])
    v2 = {path: ops for path, ops in schema["paths"].items() if path.startswith("/v2")}
    fastapis = [path for path, ops in v2.items() for op in ops.values() if "HTTPValidationError" in str(op)]
    assert not fastapis
    assert "422" not in v2["/v2/models/{name}/ready"]["get"]["responses"]
    ready = v2["/v2/models/{name}/ready"]["get"]["responses"]
    assert ready["503"]["content"]["application/json"]["schema"]["required"] == ["name", "ready"]
    assert "429" not in v2["/v2/models/{name}"]["get"]["responses"]  # metadata is never queued
    assert set(v2["/v2/health/ready"]["get"]["responses"]) == {"200", "503"}
    assert "cdn" not in page.lower()
    assert "http://" not in page
    assert "https://" not in page
    assert len(statuses) >= 4  # Swagger UI's script and style sheet, ReDoc's script, the icon
    assert set(statuses) == {200}
