"""Every script in examples/ runs as a user would run it, against a real gateway, a real worker and
RabbitMQ, on real photos: a README example that rots fails here."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtests.harness.http_load import start_gateway, stop_process
from tests.jobs.conftest import BROKER_URL, _delete_everything

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
CAT_WORDS = ("Egyptian cat", "tabby", "tiger cat")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory, cat_jpeg: bytes, coffee_jpeg: bytes) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    (folder / "cat.jpg").write_bytes(cat_jpeg)
    (folder / "coffee.jpg").write_bytes(coffee_jpeg)
    return folder


@pytest.fixture(scope="module")
def offline_env(models_dir: Path) -> Iterator[dict[str, str]]:
    """The environment of a gateway, its worker and the examples: one queue prefix, one webhook
    secret, and loopback allowed as a webhook target (it stands in for the receiver's public host)."""
    prefix = f"test-examples-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_WEBHOOK_SECRET": SECRET,
        "GATEWAY_WEBHOOK_ALLOW_HTTP": "true",
        "GATEWAY_WEBHOOK_ALLOWLIST": "127.0.0.1/32",
        "GATEWAY_URL_ALLOW_HTTP": "true",  # classify.sh's image by URL, from a server on loopback
        "GATEWAY_URL_ALLOWLIST": "127.0.0.1/32",
        "GATEWAY_LOG_LEVEL": "warning",
        "GATEWAY_COMMAND": f"{sys.executable} -m service",
    }
    yield env
    asyncio.run(_delete_everything(prefix))


@pytest.fixture(scope="module")
def gateway(offline_env: dict[str, str], models_dir: Path) -> Iterator[str]:
    proc, url = start_gateway([], models_dir, env=offline_env)
    worker = subprocess.Popen([sys.executable, "-m", "service", "worker"], env=offline_env)
    try:
        yield url
    finally:
        stop_process(worker)
        stop_process(proc)


def run(command: list[str], env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_classify_sh_labels_a_cat_by_upload_by_raw_body_and_by_url(
    gateway: str, photos: Path, offline_env: dict[str, str]
) -> None:
    handler = partial(SimpleHTTPRequestHandler, directory=str(photos))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/cat.jpg"
        output = run([str(EXAMPLES / "classify.sh"), str(photos / "cat.jpg"), gateway, url], offline_env)
        server.shutdown()
    uploaded, raw, by_url = (json.loads(line) for line in output.strip().splitlines())
    assert len(uploaded["results"][0]["labels"]) == 3
    assert len(raw["results"][0]["labels"]) == 1
    assert raw["results"][0]["labels"][0]["label"] in CAT_WORDS
    assert by_url["results"][0]["filename"] == url
    assert by_url["results"][0]["labels"][0]["label"] in CAT_WORDS


def test_the_examples_say_in_one_line_what_is_missing(tmp_path: Path, offline_env: dict[str, str]) -> None:
    """Nothing listening, a photo that is not there, no gateway command on the PATH: each example
    says so in one line on stderr and exits 2, with no traceback."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    photo = str(ROOT / "examples" / "cat.jpg")
    env = {**os.environ, "GATEWAY_WEBHOOK_SECRET": SECRET}
    cases = {
        "classify.py, nothing listening": [sys.executable, str(EXAMPLES / "classify.py"), photo, "--gateway", closed],
        "classify.py, no photo": [sys.executable, str(EXAMPLES / "classify.py"), str(tmp_path / "none.jpg")],
        "webhook_receiver.py, nothing listening": [
            sys.executable,
            str(EXAMPLES / "webhook_receiver.py"),
            photo,
            "--gateway",
            closed,
            "--listen",
            "127.0.0.1:0",
        ],
        "classify.sh, no photo": [str(EXAMPLES / "classify.sh"), str(tmp_path / "none.jpg"), closed],
    }
    for name, command in cases.items():
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 2, (name, done.returncode, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (name, done.stderr)
        assert "Traceback" not in done.stderr, name
    curl = subprocess.run([str(EXAMPLES / "classify.sh"), photo, closed], capture_output=True, text=True, timeout=60)
    assert curl.returncode != 0
    assert curl.stderr.startswith("curl: (7)"), curl.stderr  # curl's own line: could not connect
    # ingest_folder.sh with no `gateway` on the PATH finds the checkout's .venv (or says what to do)
    bare = {**offline_env, "PATH": "/usr/bin:/bin", "WORKER": "no"}
    bare.pop("GATEWAY_COMMAND")
    ingest = subprocess.run(
        [str(EXAMPLES / "ingest_folder.sh"), str(tmp_path / "no-such-folder"), str(tmp_path / "out.jsonl")],
        env=bare,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "command not found" not in ingest.stderr
    assert ingest.returncode != 0  # the folder is not there: the gateway's own refusal
    assert "no-such-folder" in ingest.stderr or "no-such-folder" in ingest.stdout


@pytest.mark.slow
def test_the_webhook_example_says_what_a_gateway_without_a_broker_lacks(
    models_dir: Path, offline_env: dict[str, str]
) -> None:
    env = {key: value for key, value in offline_env.items() if key != "GATEWAY_BROKER_URL"}
    proc, url = start_gateway([], models_dir, env=env)
    try:
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "webhook_receiver.py"),
                str(ROOT / "examples" / "cat.jpg"),
                "--gateway",
                url,
                "--listen",
                "127.0.0.1:0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        stop_process(proc)
    assert done.returncode == 1
    assert done.stderr.startswith("400 bad_request: mode=offline is not available"), done.stderr
    assert "(start the gateway with GATEWAY_BROKER_URL, and a `gateway worker`)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_classify_py_prints_the_labels_and_a_refusal_clearly(
    gateway: str, photos: Path, offline_env: dict[str, str], tmp_path: Path
) -> None:
    output = run(
        [sys.executable, str(EXAMPLES / "classify.py"), str(photos / "coffee.jpg"), "--gateway", gateway], offline_env
    )
    assert "espresso" in output.splitlines()[0]
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not a jpeg")
    refused = subprocess.run(
        [sys.executable, str(EXAMPLES / "classify.py"), str(broken), "--gateway", gateway],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert refused.stdout.startswith("400 "), refused.stdout


@pytest.mark.slow
def test_webhook_receiver_gets_and_verifies_the_signed_result(
    gateway: str, photos: Path, offline_env: dict[str, str]
) -> None:
    output = run(
        [
            sys.executable,
            str(EXAMPLES / "webhook_receiver.py"),
            str(photos / "cat.jpg"),
            "--gateway",
            gateway,
            "--listen",
            "127.0.0.1:0",
        ],
        offline_env,
    )
    delivery = json.loads(output)
    assert delivery["type"] == "job.done"
    assert delivery["data"]["job_id"] == delivery["webhook-id"]
    assert delivery["data"]["labels"][0]["label"] in CAT_WORDS


def test_the_webhook_receiver_refuses_a_forged_or_stale_signature() -> None:
    """The example's check is the real one: a signature under another secret, a changed body and
    an old timestamp are all refused."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from webhook_receiver import secret_bytes, verify  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    from service.jobs.webhooks import signature
    from service.settings.values import parse_secret

    key = parse_secret(SECRET)
    assert secret_bytes(SECRET) == key
    body, now = b'{"type":"job.done"}', 1_800_000_000
    headers = {"webhook-id": "j1", "webhook-timestamp": str(now), "webhook-signature": signature(key, "j1", now, body)}
    assert verify(key, headers, body, now=now)
    assert not verify(b"x" * 32, headers, body, now=now)
    assert not verify(key, headers, body + b" ", now=now)
    assert not verify(key, headers, body, now=now + 3600)


@pytest.mark.slow
def test_ingest_folder_sh_classifies_every_photo_once(
    gateway: str, photos: Path, offline_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    output = run([str(EXAMPLES / "ingest_folder.sh"), str(photos), str(out)], {**offline_env, "WORKER": "no"})
    assert output.strip().splitlines()[-1] == "done: 2, failed: 0"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(Path(row["path"]).name for row in rows) == ["cat.jpg", "coffee.jpg"]


def test_classify_py_names_a_dropped_connection_and_a_foreign_error_body(tmp_path: Path) -> None:
    """A server that hangs up is the gateway unreachable (not the photo unreadable); an error body
    that is JSON but not the gateway's (a list, from a proxy) is reported, not a traceback."""

    class Answers(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path.startswith("/drop/"):
                self.connection.shutdown(socket.SHUT_RDWR)  # no answer at all
                return
            body = b"[1, 2]"
            self.send_response(502)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    photo = str(ROOT / "examples" / "cat.jpg")
    try:
        dropped = subprocess.run(
            [sys.executable, str(EXAMPLES / "classify.py"), photo, "--gateway", f"{base}/drop"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert dropped.returncode == 2, dropped.stderr
        assert dropped.stderr.startswith(f"cannot reach the gateway at {base}/drop: "), dropped.stderr
        foreign = subprocess.run(
            [sys.executable, str(EXAMPLES / "classify.py"), photo, "--gateway", base],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert foreign.returncode == 1, foreign.stderr
        assert foreign.stdout.strip() == "502 Bad Gateway: the answer was not the gateway's JSON"
        assert "Traceback" not in foreign.stderr
    finally:
        server.shutdown()
