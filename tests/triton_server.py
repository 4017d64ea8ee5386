"""A real tritonserver (PyPI's pytriton binary, Python backend) for the Triton tests.

The Triton environment is built by scripts/triton-venv (scripts/test and .ci/run call it); a missing
one fails these tests rather than skipping them.
"""

from __future__ import annotations

import os
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.models.profiles import get_profile
from service.models.store import model_path
from service.triton.repository import TritonOptions, write_model
from service.triton.server import LocalTriton, Ports, TritonInstall, TritonNotInstalled

ROOT = Path(__file__).resolve().parents[1]
SLOW_SECONDS = 1.0


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _test_model(repository: Path, name: str, *, side: int, max_batch: int, queue: int, body: str) -> None:
    """A tiny Python-backend model for failure cases (slow, or declaring the wrong input shape)."""
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(
        textwrap.dedent(f"""
        name: "{name}"
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "images" data_type: TYPE_UINT8 dims: [ {side}, {side}, 3 ] }} ]
        output [ {{ name: "scores" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
        dynamic_batching {{ max_queue_delay_microseconds: 0 default_queue_policy {{ max_queue_size: {queue} }} }}
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        """)
    )
    (repository / name / "1" / "model.py").write_text(
        textwrap.dedent(f"""
        import time
        import numpy as np
        import triton_python_backend_utils as pb_utils

        class TritonPythonModel:
            def execute(self, requests):
                {body}
                out = []
                for r in requests:
                    n = pb_utils.get_input_tensor_by_name(r, "images").as_numpy().shape[0]
                    out.append(pb_utils.InferenceResponse([pb_utils.Tensor("scores", np.zeros((n, 1000), np.float32))]))
                return out
        """)
    )


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    try:
        return TritonInstall.find(Path(os.environ.get("GATEWAY_TRITON_VENV", ROOT / ".venv-triton")))
    except TritonNotInstalled as exc:
        pytest.fail(f"{exc} (scripts/test and .ci/run create it)")


@pytest.fixture(scope="session")
def triton_repository(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    repository = tmp_path_factory.mktemp("triton-repo")
    profile = get_profile("efficientnet-lite0")
    options = TritonOptions(variant="python", max_batch_size=32, intra_op_threads=1)
    write_model(repository, profile, options, model_path(models_dir, profile))
    _test_model(repository, "slow", side=224, max_batch=1, queue=1, body=f"time.sleep({SLOW_SECONDS})")
    _test_model(repository, "wrong-shape", side=100, max_batch=8, queue=8, body="pass")
    return repository


def start_triton(
    install: TritonInstall,
    repository: Path,
    log_dir: Path,
    ports: Ports | None = None,
    extra_args: tuple[str, ...] = (),
) -> LocalTriton:
    ports = ports or Ports(*free_ports(3))
    server = LocalTriton(install, repository, ports, log=log_dir / f"triton-{ports.grpc}.log", extra_args=extra_args)
    server.start(timeout=90)
    return server


@pytest.fixture(scope="module")
def triton(
    triton_install: TritonInstall, triton_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTriton]:
    server = start_triton(triton_install, triton_repository, tmp_path_factory.mktemp("triton-logs"))
    yield server
    server.stop()
