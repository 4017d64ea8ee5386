"""docs/own-models.md, run as a user runs it: a PyTorch model exported by the example script, tried
with ``gateway models check``, served with ``--model-path`` and its declaration (ONNX on the
embedded backend, its OpenVINO IR on openvino), asked with curl; its embedding variant served and
asked through ``/embed``. Real photos, real weights, real runtimes: the right ImageNet labels."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.harness.http_load import start_gateway, stop_process

pytestmark = pytest.mark.model  # the page's models, exported and served

ROOT = Path(__file__).resolve().parents[1]
DECLARATION = "--labels imagenet.txt --scale 1 --mean 127 --std 128 --output logits"
CAT_WORDS = ("Egyptian cat", "tabby", "tiger cat")
CURL = "curl -F file=@examples/cat.jpg localhost:8000/classify"


def _run(folder: Path, command: str) -> str:
    """A command of the page, as written (``.venv/bin/...`` is this interpreter's environment)."""
    argv = shlex.split(command)
    if argv[0] == ".venv/bin/python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0].startswith(".venv/bin/"):
        argv = [str(Path(sys.executable).parent / argv[0].removeprefix(".venv/bin/")), *argv[1:]]
    result = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _page_commands() -> list[str]:
    """Every command of the page's sh blocks."""
    text = (ROOT / "docs" / "own-models.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```sh\n")[1:]]
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder like a checkout's root: the page's commands use its examples (and their cat)."""
    folder = tmp_path_factory.mktemp("own-models")
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def _served(command: str) -> list[str]:
    """A page's ``gateway serve ...`` command as start_gateway's arguments."""
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/gateway", "serve"], command
    return argv[2:]


def _curl(url: str, command: str, folder: Path) -> dict[str, object]:
    argv = shlex.split(command.replace("localhost:8000", url))
    result = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answer: dict[str, object] = json.loads(result.stdout)
    return answer


def test_the_pages_commands_are_the_ones_run_here() -> None:
    commands = _page_commands()
    assert (
        ".venv/bin/python examples/export_efficientnet_lite.py lite2 --out lite2.onnx --labels imagenet.txt" in commands
    )
    assert f".venv/bin/gateway models check lite2.onnx {DECLARATION} --photo examples/cat.jpg" in commands
    assert f".venv/bin/gateway serve --model-path lite2.onnx {DECLARATION}" in commands
    assert CURL in commands
    assert ".venv/bin/ovc lite2.onnx --output_model lite2.xml" in commands


def test_a_pytorch_export_is_checked_served_and_answers_as_the_page_says(folder: Path) -> None:
    commands = _page_commands()
    _run(folder, commands[0])  # the export
    checked = _run(folder, next(c for c in commands if c.startswith(".venv/bin/gateway models check")))
    assert "input  'input' [?, 3, 260, 260] float32" in checked
    answer_line = next(line for line in checked.splitlines() if line.startswith("examples/cat.jpg: "))
    assert answer_line.removeprefix("examples/cat.jpg: ").startswith(CAT_WORDS), answer_line
    assert "note:" not in checked  # logits declared as such
    serve = next(c for c in commands if c.startswith(".venv/bin/gateway serve --model-path lite2.onnx"))
    proc, url = start_gateway(_served(serve), folder / "cache", cwd=folder)
    try:
        answer = _curl(url, CURL, folder)
    finally:
        stop_process(proc)
    assert answer["model"] == {"name": "lite2", "version": "1", "random_weights": False}
    labels = answer["results"][0]["labels"]  # type: ignore[index]
    assert labels[0]["label"] in CAT_WORDS, labels
    assert 0.5 < labels[0]["score"] <= 1.0  # softmax of the logits, in the graph


def test_the_embedding_and_the_openvino_ir_of_the_page_answer(folder: Path) -> None:
    commands = _page_commands()
    if not (folder / "lite2.onnx").exists():
        _run(folder, commands[0])
    _run(folder, next(c for c in commands if "--embedding" in c))
    serve = next(c for c in commands if "lite2-features.onnx" in c and " serve " in c)
    proc, url = start_gateway(_served(serve), folder / "cache", cwd=folder)
    try:
        answer = _curl(url, next(c for c in commands if "/embed" in c and c.startswith("curl")), folder)
    finally:
        stop_process(proc)
    (embedding,) = answer["embeddings"]  # type: ignore[misc]
    assert embedding["dimensions"] == 1280
    assert len(embedding["vector"]) == 1280
    assert min(embedding["vector"]) >= 0  # ReLU6 features, pooled
    _run(folder, next(c for c in commands if c.startswith(".venv/bin/ovc")))
    serve = next(c for c in commands if "--model-path lite2.xml" in c)
    proc, url = start_gateway(_served(serve), folder / "cache", cwd=folder)
    try:
        answer = _curl(url, CURL, folder)
    finally:
        stop_process(proc)
    assert answer["results"][0]["labels"][0]["label"] in CAT_WORDS  # type: ignore[index]
