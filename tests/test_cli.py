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


def _help(*words: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "service", *words, "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout


def test_each_command_shows_only_the_settings_it_uses_grouped_by_concern() -> None:
    """``serve --help``: a one-line usage, then a group per concern, each about a screenful, each flag
    with its default and variable; the other commands show only the groups they use."""
    from service.cli.flags import GROUPS

    serve = _help("serve")
    assert serve.startswith("usage: gateway serve [options]\n")
    sections = re.split(r"\n(?=[A-Za-z][^\n]*\):\n)", serve)
    titles = [section.split(" (", 1)[0] for section in sections[1:]]
    assert titles == list(GROUPS)
    assert all(len(section.splitlines()) <= 70 for section in sections), [len(s.splitlines()) for s in sections]
    words = " ".join(serve.split())
    assert "--port N TCP port of the HTTP server (0 picks a free one) [default: 8000; env GATEWAY_PORT]" in words
    assert "--url-inputs, --no-url-inputs" in serve  # a switch, not --url-inputs URL_INPUTS
    alive = _help("alive")
    assert "GATEWAY_" not in alive
    assert len(alive.splitlines()) < 10
    engine, policies = _help("engine"), _help("queues", "policies")
    assert "--webhook-secret" not in engine
    assert "--max-batch-size" in engine
    assert set(re.findall(r"^(\w[^\n(]*) \(", policies, re.M)) == {"offline"}


def test_booleans_are_switches_and_an_absent_one_leaves_the_environment_to_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service.cli.common import load_settings as _settings

    parse = build_parser().parse_args
    assert _settings(parse(["serve", "--no-url-inputs"])).url_inputs is False
    monkeypatch.setenv("GATEWAY_ACCESS_LOG", "true")
    assert _settings(parse(["serve"])).access_log is True  # not given: the environment's
    assert _settings(parse(["serve", "--no-access-log"])).access_log is False  # the flag over it


def test_a_flag_missing_its_value_says_so_in_two_lines_naming_the_variable() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--max-delay"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "gateway serve: error: --max-delay / GATEWAY_MAX_DELAY: expected one argument; expected SECONDS",
        "(see: gateway serve --help)",
    ]


def test_settings_effective_says_where_each_value_came_from_and_masks_secrets() -> None:
    env = {
        **os.environ,
        "GATEWAY_MAX_BATCH_SIZE": "8",
        "GATEWAY_API_KEYS": "a-very-secret-key",
        "GATEWAY_BROKER_URL": "amqp://user:hunter2@rabbit:5672/",
        "GATEWAY_TRACING_ENDPOINT": "http://otel:s3cret@collector:4317",
        "gateway_log_level": "debug",
    }
    env.pop("GATEWAY_MAX_DELAY", None)
    done = subprocess.run(
        [sys.executable, "-m", "service", "settings", "--effective", "--port", "9001", "--no-url-inputs"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in done.stdout.splitlines()}
    assert rows["GATEWAY_PORT"] == ["flag", "9001"]
    assert rows["GATEWAY_URL_INPUTS"] == ["flag", "false"]
    assert rows["GATEWAY_MAX_BATCH_SIZE"] == ["environment", "8"]
    assert rows["GATEWAY_MAX_DELAY"] == ["default", "0.005"]
    assert rows["GATEWAY_API_KEYS"] == ["environment", "********"]
    assert rows["GATEWAY_BROKER_URL"] == ["environment", "amqp://user:***@rabbit:5672/"]
    assert rows["GATEWAY_TRACING_ENDPOINT"] == ["environment", "http://otel:***@collector:4317"]
    assert rows["GATEWAY_LOG_LEVEL"] == ["environment", "debug"]  # the variable in any case, as it is read
    assert rows["GATEWAY_MAX_BUFFERED_BODY_BYTES"][0] == "default"
    assert rows["GATEWAY_MAX_BUFFERED_BODY_BYTES"][1].startswith("0 (in effect: ")  # the figure it works out
    assert "a-very-secret-key" not in done.stdout
    assert "hunter2" not in done.stdout
    assert "s3cret" not in done.stdout
    assert set(rows) == {f"GATEWAY_{name.upper()}" for name in Settings.model_fields}


def test_the_cli_reference_page_is_made_from_the_parser() -> None:
    """docs/cli.md is what ``gateway settings --cli-reference`` prints: a command or flag added or
    changed without regenerating the page fails here."""
    from service.cli.reference import cli_reference

    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert page == cli_reference(build_parser()), "docs/cli.md is out of date: gateway settings --cli-reference"
    assert "## gateway serve\n" in page
    assert "## gateway models check\n" in page


def test_each_command_takes_the_settings_its_code_reads() -> None:
    """Flags a command's own code reads: the worker's metrics listen on --host and its models run on
    the GPU; the engine sizes its queue by --workers; models are built for a --torch-device; ingest
    checks --model against the --models-file."""
    parse = build_parser().parse_args
    worker = parse(["worker", "--host", "0.0.0.0", "--torch-device", "cpu", "--webhook-secret", "s"])
    assert (worker.host, worker.torch_device) == ("0.0.0.0", "cpu")
    engine = parse(
        ["engine", "--socket", "e.sock", "--workers", "4", "--torch-precision", "fp16", "--model", "resnet50"]
    )
    assert (engine.workers, engine.torch_precision, engine.model) == ("4", "fp16", "resnet50")
    assert parse(["models", "build", "--torch-device", "cpu"]).torch_device == "cpu"
    assert parse(["models", "check", "m.onnx", "--torch-device", "cpu"]).torch_device == "cpu"
    ingest = parse(["ingest", "photos", "--out", "o.jsonl", "--models-file", "models.yaml", "--model", "lite"])
    assert (ingest.models_file, ingest.target_model, getattr(ingest, "model", None)) == ("models.yaml", "lite", None)


def _usage_error(*words: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "service", *words], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    return done.stderr.splitlines()


def test_a_switch_given_a_value_is_refused_not_read_as_a_path() -> None:
    """``--access-log false`` (the old form) must not make ``false`` a photo folder to ingest."""
    assert _usage_error("ingest", "--out", "o.jsonl", "--access-log", "false", "photos")[0] == (
        "gateway ingest: error: --access-log / GATEWAY_ACCESS_LOG: a switch takes no value ('false'); "
        "a switch: --access-log turns it on, --no-access-log off"
    )
    assert _usage_error("serve", "--url-inputs=no")[0].startswith(
        "gateway serve: error: --url-inputs / GATEWAY_URL_INPUTS: ignored explicit argument 'no'"
    )


def test_flags_are_not_abbreviated_and_a_commands_own_flags_keep_their_names() -> None:
    assert _usage_error("serve", "--max-batch", "8")[0].endswith("error: unrecognized arguments: --max-batch 8")
    top_k = _usage_error("ingest", "photos", "--out", "o.jsonl", "--model")[0]
    assert top_k == "gateway ingest: error: argument --model: expected one argument"  # ingest's, not GATEWAY_MODEL
