"""Every script in examples/ runs as a user would run it, against a real gateway, a real worker and
RabbitMQ, on real photos: a README example that rots fails here."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
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
def test_classify_sh_labels_a_cat_by_upload_and_by_raw_body(
    gateway: str, photos: Path, offline_env: dict[str, str]
) -> None:
    output = run([str(EXAMPLES / "classify.sh"), str(photos / "cat.jpg"), gateway], offline_env)
    uploaded, raw = (json.loads(line) for line in output.strip().splitlines())
    assert len(uploaded["results"][0]["labels"]) == 3
    assert len(raw["results"][0]["labels"]) == 1
    assert raw["results"][0]["labels"][0]["label"] in CAT_WORDS


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
