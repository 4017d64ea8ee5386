"""``gateway models fetch``: a checkpoint served from a loopback HTTP server is kept only when its
SHA-256 (and, for the pinned file, its size) is right, then becomes the model's weights; a model
without weights says so in every answer and in /readyz."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.cli import main
from service.images.preprocess import PreprocessConfig, prepare
from service.models import resnet
from service.models.checkpoints import CHECKPOINTS, checkpoint_path, weights_for
from service.models.profiles import get_profile
from service.models.store import model_path
from service.settings import Settings
from tests.conftest import running_gateway
from tests.torch_files import write_zip

pytestmark = pytest.mark.model  # checkpoints built into models and run


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A ResNet-50 state_dict in torch's zip format: seed-1 weights, not the seed-0 default's."""
    path = tmp_path_factory.mktemp("ckpt") / "resnet50-test.pth"
    write_zip(path, resnet.random_state_dict(seed=1))
    return path.read_bytes()


@contextmanager
def serving(files: dict[str, bytes]) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on loopback serving ``files`` by path; yields its base URL and the paths asked for."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def fetch(models_dir: Path, *args: str) -> None:
    assert main(["models", "fetch", "resnet50", "--models-dir", str(models_dir), *args]) == 0


def leftovers(models_dir: Path) -> list[Path]:
    folder = models_dir / "checkpoints"
    return sorted(folder.iterdir()) if folder.exists() else []


def test_a_verified_checkpoint_is_kept_and_builds_the_model(tmp_path: Path, checkpoint: bytes, cat_jpeg: bytes) -> None:
    sha = hashlib.sha256(checkpoint).hexdigest()
    with serving({"/r50.pth": checkpoint}) as (base, asked):
        fetch(tmp_path, "--url", f"{base}/r50.pth", "--sha256", sha, "--triton-repo", str(tmp_path / "repo"))
        fetch(tmp_path, "--url", f"{base}/r50.pth", "--sha256", sha)  # kept already: not fetched again
    assert asked == ["/r50.pth"]
    kept = checkpoint_path(tmp_path, "resnet50")
    assert kept.read_bytes() == checkpoint
    assert json.loads(kept.with_suffix(".json").read_text())["sha256"] == sha
    settings = Settings(models_dir=tmp_path, model="resnet50")
    assert weights_for(settings, "resnet50") == kept

    onnx = model_path(tmp_path, get_profile("resnet50"))
    assert (tmp_path / "repo" / "resnet50" / "1" / "model.onnx").read_bytes() == onnx.read_bytes()
    batch = prepare(cat_jpeg, PreprocessConfig())[None]
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    built = session.run(None, {session.get_inputs()[0].name: batch})[0]
    default = ort.InferenceSession(resnet.build(resnet.random_state_dict(seed=0)).SerializeToString())
    random = default.run(None, {default.get_inputs()[0].name: batch})[0]
    assert not np.allclose(built, random, atol=1e-3)  # the fetched weights, not the seed-0 default


def test_a_corrupted_or_substituted_checkpoint_is_refused(tmp_path: Path, checkpoint: bytes) -> None:
    sha = hashlib.sha256(checkpoint).hexdigest()
    flipped = bytearray(checkpoint)
    flipped[len(flipped) // 2] ^= 0x01
    with serving({"/flipped.pth": bytes(flipped), "/r50.pth": checkpoint}) as (base, _):
        with pytest.raises(SystemExit, match=f"SHA-256 [0-9a-f]{{64}}, not the pinned {sha}"):
            fetch(tmp_path, "--url", f"{base}/flipped.pth", "--sha256", sha)
        # a mirror of the pinned torchvision file must be that file: this one's size already differs
        pinned = CHECKPOINTS["resnet50"]
        with pytest.raises(SystemExit, match=f"at most {pinned.size} expected|pinned checkpoint has {pinned.size}"):
            fetch(tmp_path, "--url", f"{base}/r50.pth")
        with pytest.raises(SystemExit, match="404"):
            fetch(tmp_path, "--url", f"{base}/missing.pth", "--sha256", sha)
    assert leftovers(tmp_path) == []  # no partial file, no record
    assert weights_for(Settings(models_dir=tmp_path, model="resnet50"), "resnet50") is None


async def test_random_weights_are_flagged_in_every_answer(models_dir: Path, cat_jpeg: bytes) -> None:
    random = Settings(models_dir=models_dir, model="trivial")
    async with running_gateway(random) as client:
        answer = (await client.post("/classify", content=cat_jpeg, headers={"Content-Type": "image/jpeg"})).json()
        ready = (await client.get("/readyz")).json()
    assert answer["model"] == {"name": "trivial", "version": "1", "random_weights": True}
    assert ready["ready"] is True
    assert ready["checks"]["weights"].startswith("RANDOM")
    real = Settings(models_dir=models_dir, model="efficientnet-lite0")
    async with running_gateway(real) as client:
        answer = (await client.post("/classify", content=cat_jpeg, headers={"Content-Type": "image/jpeg"})).json()
        ready = (await client.get("/readyz")).json()
    assert answer["model"]["random_weights"] is False
    assert ready["checks"]["weights"] == "ok"
