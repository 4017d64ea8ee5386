"""The installed entry points, run as a user would run them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.cli import build_parser
from service.settings import Settings
from tests.conftest import CAT_CLASSES, free_port


def test_every_setting_is_a_documented_flag() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {a.dest: a for a in serve._actions if a.dest in Settings.model_fields}
    assert set(flags) == set(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        assert field.description, f"setting {name} has no docstring"
        assert f"GATEWAY_{name.upper()}" in (flags[name].help or "")


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli.common import load_settings as _settings

    monkeypatch.setenv("GATEWAY_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("GATEWAY_MAX_DELAY", "0.02")
    args = build_parser().parse_args(["serve", "--max-batch-size", "32"])
    settings = _settings(args)
    assert settings.max_batch_size == 32
    assert settings.max_delay == 0.02


def test_invalid_settings_are_refused_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli.common import load_settings as _settings

    with pytest.raises(SystemExit, match="--model / GATEWAY_MODEL: unknown profile 'vgg16'"):
        _settings(build_parser().parse_args(["serve", "--model", "vgg16"]))
    with pytest.raises(ValueError, match="GATEWAY_MAX_QUEUE_SIZE"):
        Settings(max_queue_size=4, max_images_per_request=8)
    with pytest.raises(ValueError, match="one image must fit"):
        Settings(max_image_bytes=10_000_000, max_decode_bytes=5_000_000)
    assert Settings(max_image_bytes=10_000_000).max_decode_bytes_effective == 20_000_000


def test_models_build_then_list(tmp_path: Path) -> None:
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(tmp_path)}
    built = subprocess.run(
        [sys.executable, "-m", "service", "models", "build"], env=env, capture_output=True, text=True, check=True
    )
    assert Path(built.stdout.strip()) == tmp_path / "efficientnet-lite0" / "1" / "model.onnx"
    listing = subprocess.run(
        [sys.executable, "-m", "service", "models", "list"], env=env, capture_output=True, text=True, check=True
    )
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()}
    assert "not built" not in lines["efficientnet-lite0"]
    assert "not built" in lines["resnet50"]


@pytest.mark.slow
def test_gateway_command_serves_a_cat_and_stops_on_sigterm(tmp_path: Path, models_dir: Path, cat_jpeg: bytes) -> None:
    """`gateway` with no arguments serves the embedded model; SIGTERM stops it cleanly."""
    port = free_port()
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(models_dir), "GATEWAY_PORT": str(port)}
    gateway = Path(sys.executable).with_name("gateway")
    proc = subprocess.Popen([str(gateway)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "gateway did not become ready"
            time.sleep(0.1)
        response = httpx.post(
            f"http://127.0.0.1:{port}/classify", files={"file": ("cat.jpg", cat_jpeg, "image/jpeg")}, timeout=30
        )
        assert response.status_code == 200
        assert response.json()["results"][0]["labels"][0]["index"] in CAT_CLASSES
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    # uvicorn re-raises the signal after a graceful shutdown, so the status may be -SIGTERM
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "gateway ready" in output
    assert "Application shutdown complete" in output
    assert "POST /classify" not in output  # no access log by default: metrics count requests


def test_several_workers_clear_only_stale_metric_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --workers N` with PROMETHEUS_MULTIPROC_DIR set removes the previous run's metric files
    there and nothing else (it used to delete the whole folder, whatever it named)."""
    from service.cli.serve import prepare_multiprocess as _prepare_multiprocess

    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "counter_123.db").write_bytes(b"stale")
    (folder / "gauge_livesum_123.db").write_bytes(b"stale")
    (folder / "notes.txt").write_text("the operator's")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    monkeypatch.setenv("GATEWAY_WORKERS", "1")  # the call exports the flags: restored after the test
    _prepare_multiprocess(build_parser().parse_args(["serve", "--workers", "2"]))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(folder)


def test_settings_of_earlier_versions_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment still setting GATEWAY_MAX_IMAGE_PIXELS is told what replaced it, not ignored."""
    monkeypatch.setenv("GATEWAY_MAX_IMAGE_PIXELS", "50000000")
    with pytest.raises(ValueError, match="GATEWAY_MAX_IMAGE_PIXELS is replaced by GATEWAY_MAX_IMAGE_BYTES"):
        Settings()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_ends_serve_before_anything_starts(workers: str) -> None:
    """``gateway serve`` on a port another server holds exits 1 at once, saying the address and the
    settings to change, before any worker or model starts and without ever logging ``gateway ready``
    (it used to load the model, log ready, and only then fail to bind)."""
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "service", "serve", "--backend", "fake", "--port", str(port), "--workers", workers],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "--port / GATEWAY_PORT" in done.stderr
    for started in ("gateway ready", "startup", "model", "Started"):
        assert started not in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_listens_before_it_loads_and_answers_who_waited(tmp_path: Path) -> None:
    """``gateway serve --port 0`` says the address it listens on before the models load, and only
    then ``gateway ready``; a request sent while the models load waits in the backlog and is
    answered once they are loaded, not refused."""
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(tmp_path), "GATEWAY_FAKE_DELAY": "0"}
    command = [sys.executable, "-m", "service", "serve", "--backend", "fake", "--port", "0"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = iter(proc.stderr.readline, "")
        listening = next(line for line in lines if "listening on" in line or "gateway ready" in line)
        address = re.search(r"listening on http://127\.0\.0\.1:(\d+)", listening)
        assert address is not None, listening  # said first, before "gateway ready"
        early = socket.create_connection(("127.0.0.1", int(address[1])), timeout=30)
        with early:
            early.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert any("gateway ready" in line for line in lines)
            answer = b""
            while chunk := early.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
