"""``gateway serve`` as an operator runs it: the gRPC port beside the HTTP one, served by every
worker process, and a gRPC port in use found before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc

from loadtests.harness.http_load import start_gateway, stop_process
from service.tune.runner import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_grpc_port_in_use_ends_serve_before_anything_starts(workers: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        env = {**os.environ, "GATEWAY_GRPC_PORT": str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "service", "serve", "--backend", "fake", "--port", "0", "--workers", workers],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use for gRPC" in done.stderr
    assert "GATEWAY_GRPC_PORT" in done.stderr
    assert "gateway ready" not in done.stderr
    assert "Traceback" not in done.stderr


def test_every_worker_serves_the_grpc_port(tmp_path: Path, models_dir: Path, cat_jpeg: bytes) -> None:
    """Two workers, one gRPC port: each worker process listens on it (``SO_REUSEPORT``: the kernel
    spreads the connections), every call is answered, and /metrics sums the calls of both."""
    http, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_GRPC_PORT": str(grpc_port),
        "GATEWAY_LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "service", "serve", "--port", str(http), "--workers", "2"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        answered = 0
        while answered < 20:
            assert time.monotonic() < deadline, "the gRPC front did not answer"
            client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")  # a connection each
            try:
                tensor = triton_grpc.InferInput("IMAGE", [1], "BYTES")
                tensor.set_data_from_numpy(np.array([cat_jpeg], dtype=np.object_))
                result = client.infer("efficientnet-lite0", [tensor])
                assert result.as_numpy("PROBABILITIES").shape == (1, 1000)
                answered += 1
            except triton_grpc.InferenceServerException:
                time.sleep(0.5)  # the workers are still loading
            finally:
                client.close()
        listening: set[int] = set()
        while len(listening) < 2 and time.monotonic() < deadline:  # a worker may still be loading
            listening = {
                child.pid
                for child in psutil.Process(proc.pid).children()
                for connection in child.net_connections(kind="tcp")
                if connection.status == psutil.CONN_LISTEN and connection.laddr.port == grpc_port
            }
            time.sleep(0.2)
        assert len(listening) == 2, listening
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as response:
            exposition = response.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    [line] = [
        line
        for line in exposition.splitlines()
        if line.startswith('gateway_grpc_requests_total{code="OK",method="ModelInfer"}')
    ]
    assert float(line.split()[-1]) >= 20  # summed over both workers


def test_the_grpc_example_classifies_by_call_and_by_stream(models_dir: Path, tmp_path: Path, cat_jpeg: bytes) -> None:
    """examples/classify_grpc.py, run as docs/api.md shows it, against ``gateway serve``."""
    (tmp_path / "cat.jpg").write_bytes(cat_jpeg)
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    port = free_port()
    proc, _ = start_gateway([], models_dir, env={"GATEWAY_GRPC_PORT": str(port)})
    example = [sys.executable, str(ROOT / "examples" / "classify_grpc.py"), "--url", f"127.0.0.1:{port}"]
    try:
        calls = subprocess.run([*example, str(tmp_path / "cat.jpg")], capture_output=True, text=True, timeout=60)
        stream = subprocess.run(
            [*example, "--stream", "--top-k", "1", str(tmp_path / "cat.jpg"), str(tmp_path / "cat.jpg")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        refused = subprocess.run([*example, str(tmp_path / "broken.jpg")], capture_output=True, text=True, timeout=60)
    finally:
        stop_process(proc)
    assert calls.returncode == 0, calls.stderr
    assert calls.stdout.startswith("cat.jpg: ")
    assert any(word in calls.stdout for word in ("Egyptian cat", "tabby", "tiger cat"))
    assert len(calls.stdout.split(" | ")) == 3
    assert stream.returncode == 0, stream.stderr
    assert stream.stdout.count("cat.jpg: ") == 2
    assert refused.returncode == 1
    assert refused.stderr.startswith("refused: StatusCode.INVALID_ARGUMENT"), refused.stderr
