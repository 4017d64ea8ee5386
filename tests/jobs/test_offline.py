"""Offline mode against the real RabbitMQ: the API, the worker, ingest, and what must not be lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.backends.base import Images
from service.backends.fake import FakeBackend
from service.errors import BackendError
from service.jobs.messages import DETAIL_HEADER, ERROR_HEADER, PUBLISHED_HEADER, request_message
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.settings import Settings
from tests.conftest import CAT_CLASSES, ESPRESSO, free_port, png_bytes, running_gateway, solid_image
from tests.jobs.conftest import (
    BROKER_URL,
    broker_ok,
    class_pngs,
    collect_results,
    drain,
    gateway_process,
    photo_variants,
    publish,
    queue_depth,
    wait_for_line,
    worker_pids,
)

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]


def offline_settings(make: MakeSettings, prefix: str, **kw: object) -> Settings:
    return make(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, **kw)


async def wait_job(client: httpx.AsyncClient, job_id: str, timeout: float = 60) -> dict[str, object]:
    async with asyncio.timeout(timeout):
        while True:
            body = (await client.get(f"/jobs/{job_id}")).json()
            if body["status"] != "pending":
                return body  # type: ignore[no-any-return]
            await asyncio.sleep(0.05)


async def test_offline_request_is_queued_classified_and_reported(
    gateway_factory: MakeSettings, prefix: str, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """POST mode=offline answers 202 with a job per image; a worker classifies them; GET /jobs
    says pending, then done with the labels, or failed with the reason; unknown ids are 404."""
    settings = offline_settings(gateway_factory, prefix)
    stop = asyncio.Event()
    async with running_gateway(settings) as client:
        await broker_ok(client)
        files = [
            ("file", ("cat.jpg", cat_jpeg, "image/jpeg")),
            ("file", ("coffee.jpg", coffee_jpeg, "image/jpeg")),
            ("file", ("empty-looking.png", png_bytes(solid_image(0, 1)), "image/png")),
        ]
        accepted = await client.post("/classify", params={"mode": "offline", "top_k": 2}, files=files)
        assert accepted.status_code == 202, accepted.text
        jobs = accepted.json()["jobs"]
        assert [j["filename"] for j in jobs] == ["cat.jpg", "coffee.jpg", "empty-looking.png"]
        assert (await client.get(jobs[0]["status_url"])).json()["status"] == "pending"  # no worker yet

        worker = asyncio.create_task(run_worker(settings, stop))
        cat, coffee, tiny = [await wait_job(client, j["job_id"]) for j in jobs]
        assert cat["status"] == "done"
        assert cat["labels"][0]["index"] in CAT_CLASSES  # type: ignore[index]
        assert len(cat["labels"]) == 2  # type: ignore[arg-type]
        assert coffee["labels"][0]["index"] == ESPRESSO  # type: ignore[index]
        assert coffee["model"] == {"name": "efficientnet-lite0", "version": "1", "random_weights": False}
        assert tiny["status"] == "done"  # a 1x1 image is valid

        bad = await client.post(
            "/classify",
            params={"mode": "offline"},
            content=b"\xff\xd8\xff\xe0junk",
            headers={"content-type": "image/jpeg"},
        )
        assert bad.status_code == 400  # refused before publishing: the header has no frame
        missing = await client.get("/jobs/0123456789abcdef")
        assert missing.status_code == 404
        assert missing.json()["error"] == "not_found"
        stop.set()
        await worker


async def test_api_answers_503_fast_when_the_broker_is_unreachable(gateway_factory: MakeSettings) -> None:
    """No broker: offline requests get 503 at once (no hang), online requests still work."""
    settings = gateway_factory(broker_url="amqp://guest:guest@127.0.0.1:1/", queue_prefix="unused", backend="fake")
    async with running_gateway(settings, FakeBackend()) as client:
        png = png_bytes(solid_image(3, 16))
        started = time.monotonic()
        offline = await client.post(
            "/classify", params={"mode": "offline"}, content=png, headers={"content-type": "image/png"}
        )
        assert time.monotonic() - started < 1.0
        assert offline.status_code == 503
        assert offline.json()["error"] == "backend_unavailable"
        assert "broker" in offline.json()["detail"]
        assert "127.0.0.1" not in offline.json()["detail"]  # nor the broker's address (issue 46)
        assert "guest" not in offline.json()["detail"]
        online = await client.post("/classify", content=png, headers={"content-type": "image/png"})
        assert online.status_code == 200
        readyz = (await client.get("/readyz")).json()
        assert readyz["ready"] is True
        assert readyz["checks"]["broker"].startswith("not connected")


async def test_offline_without_a_broker_configured_is_400(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        png = png_bytes(solid_image(3, 16))
        response = await client.post(
            "/classify", params={"mode": "offline"}, content=png, headers={"content-type": "image/png"}
        )
        assert response.status_code == 400
        assert "not available" in response.json()["detail"]


def _env(prefix: str, models_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_WORKER_METRICS_PORT": "0",
        **extra,
    }


def _ingest(folder: Path, out: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "ingest", str(folder), "--out", str(out), "--resend-after", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _results(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_ingest_500_photos_gives_500_distinct_correct_results(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    subjects = photo_variants(tmp_path / "photos", 500)
    env = _env(prefix, models_dir)
    log = tmp_path / "worker.log"
    worker = gateway_process(["worker"], env, log)
    try:
        wait_for_line(log, "worker ready")
        done = _ingest(tmp_path / "photos", tmp_path / "out.jsonl", env)
        assert done.returncode == 0, done.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    results = _results(tmp_path / "out.jsonl")
    assert len(results) == 500
    assert {r["path"] for r in results} == {str(p) for p in subjects}
    assert len({r["job_id"] for r in results}) == 500
    wrong = []
    for r in results:
        top = r["labels"][0]["index"]  # type: ignore[index]
        expected = CAT_CLASSES if subjects[Path(str(r["path"]))] == "cat" else {ESPRESSO}
        if top not in expected:
            wrong.append((r["path"], r["labels"][0]))  # type: ignore[index]
    assert not wrong
    # a second run has nothing left to do
    again = _ingest(tmp_path / "photos", tmp_path / "out.jsonl", env)
    assert "nothing to do" in again.stderr
    assert len(_results(tmp_path / "out.jsonl")) == 500


def _ingest_with_disruption(
    tmp_path: Path,
    prefix: str,
    models_dir: Path,
    disrupt: Callable[[], None],
    workers: int,
    env: dict[str, str] | None = None,
) -> dict[Path, int]:
    """Ingest 300 images through slow fake-backend workers; call ``disrupt`` when about a third of
    the results are in; return the images' expected classes."""
    classes = class_pngs(tmp_path / "images", 300)
    env = env or _env(prefix, models_dir, GATEWAY_BACKEND="fake", GATEWAY_FAKE_DELAY="0.05", GATEWAY_MAX_BATCH_SIZE="4")
    procs = []
    for i in range(workers):
        log = tmp_path / f"worker-{i}.log"
        procs.append(gateway_process(["worker"], env, log))
        wait_for_line(log, "worker ready")
    out = tmp_path / "out.jsonl"
    ingest = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "ingest",
            str(tmp_path / "images"),
            "--out",
            str(out),
            "--resend-after",
            "60",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or len(out.read_text().splitlines()) < 100:
            assert ingest.poll() is None, ingest.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        disrupt()
        _, stderr = ingest.communicate(timeout=240)
        assert ingest.returncode == 0, stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        if ingest.poll() is None:
            ingest.kill()
    results = _results(out)
    assert len(results) == 300
    assert {r["path"] for r in results} == {str(p) for p in classes}
    assert all(r["status"] == "done" for r in results)
    assert all(r["labels"][0]["index"] == classes[Path(str(r["path"]))] for r in results)  # type: ignore[index]
    return classes


@pytest.mark.slow
def test_worker_killed_mid_ingest_loses_nothing(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """SIGKILL one of two workers mid-run: its unacknowledged messages go to the other."""
    killed: list[int] = []

    def kill_first_worker() -> None:
        pids = worker_pids(prefix)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    _ingest_with_disruption(tmp_path, prefix, models_dir, kill_first_worker, workers=2)
    assert killed


@pytest.mark.slow
@pytest.mark.serial  # the broker every other test uses goes down
def test_broker_restart_mid_ingest_loses_nothing(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """Stop and start RabbitMQ mid-run: durable queues, persistent messages, confirms and acks
    after results bring every image through."""

    def restart_broker() -> None:
        subprocess.run(["rabbitmqctl", "stop_app"], check=True, capture_output=True, timeout=120)
        time.sleep(1)
        subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)

    _ingest_with_disruption(tmp_path, prefix, models_dir, restart_broker, workers=1)


@pytest.mark.slow
def test_worker_sigterm_mid_ingest_finishes_its_messages_and_loses_none(
    tmp_path: Path, prefix: str, models_dir: Path
) -> None:
    """SIGTERM: the worker stops consuming, finishes and acks what it holds, and exits cleanly; a
    new worker takes over the rest."""
    env = _env(prefix, models_dir, GATEWAY_BACKEND="fake", GATEWAY_FAKE_DELAY="0.05", GATEWAY_MAX_BATCH_SIZE="4")
    replacement: list[subprocess.Popen[bytes]] = []

    def stop_and_replace() -> None:
        (pid,) = worker_pids(prefix)
        os.kill(pid, signal.SIGTERM)
        wait_for_line(tmp_path / "worker-0.log", "worker: stopped", timeout=60)
        log = tmp_path / "worker-new.log"
        replacement.append(gateway_process(["worker"], env, log))
        wait_for_line(log, "worker ready")

    try:
        _ingest_with_disruption(tmp_path, prefix, models_dir, stop_and_replace, workers=1, env=env)
    finally:
        for proc in replacement:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert (
        "finishing" in (tmp_path / "worker-0.log").read_text() or "stopping" in (tmp_path / "worker-0.log").read_text()
    )


async def test_poison_message_is_dead_lettered_once_and_the_rest_flow_on(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    names = Names(prefix)
    settings = offline_settings(gateway_factory, prefix, backend="fake")
    good = [
        request_message(
            png_bytes(solid_image(v, 8)),
            job_id=f"good-{v}",
            content_type="image/png",
            filename=None,
            top_k=1,
            reply_to="jobs",
        )
        for v in (1, 2, 3)
    ]
    poison = request_message(
        b"this is not an image", job_id="poison", content_type="image/jpeg", filename="p.jpg", top_k=1, reply_to="jobs"
    )
    await publish(names, good[0], poison, *good[1:])
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    results = {r.job_id: r for r in await collect_results(names, 4)}
    await asyncio.sleep(0.5)  # time for any (wrong) redelivery of the poison message to show up
    stop.set()
    await worker
    assert {k: r.status for k, r in results.items()} == {
        "good-1": "done",
        "good-2": "done",
        "good-3": "done",
        "poison": "failed",
    }
    assert results["good-2"].labels[0].index == 2
    assert results["poison"].error is not None
    assert results["poison"].error.error == "bad_image"
    dead = await drain(names.dead)
    assert len(dead) == 1
    assert dead[0].message_id == "poison"
    assert dead[0].headers[ERROR_HEADER] == "bad_image"
    assert "not a recognised image" in str(dead[0].headers[DETAIL_HEADER])
    assert await queue_depth(names.work) == 0


class AlwaysFailing(FakeBackend):
    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        self.batches.append(len(images))
        raise BackendError("simulated device error")


async def test_backend_failures_retry_then_dead_letter(gateway_factory: MakeSettings, prefix: str) -> None:
    names = Names(prefix)
    settings = offline_settings(gateway_factory, prefix, backend="fake", max_retries=2)
    message = request_message(
        png_bytes(solid_image(5, 8)),
        job_id="unlucky",
        content_type="image/png",
        filename=None,
        top_k=1,
        reply_to="jobs",
    )
    await publish(names, message)
    backend = AlwaysFailing()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=backend))
    (result,) = await collect_results(names, 1)
    stop.set()
    await worker
    assert backend.batches == [1, 1, 1]  # the first try and 2 retries
    assert result.status == "failed"
    assert result.error is not None
    assert "simulated device error" in result.error.detail
    (dead,) = await drain(names.dead)
    assert dead.headers[ERROR_HEADER] == "backend_error"
    assert dead.headers["x-retries"] == 2


async def test_worker_exports_its_metrics_on_its_own_port(gateway_factory: MakeSettings, prefix: str) -> None:
    port = free_port()
    names = Names(prefix)
    settings = offline_settings(gateway_factory, prefix, backend="fake")
    settings = settings.model_copy(update={"worker_metrics_port": port})
    messages = [
        request_message(
            png_bytes(solid_image(v, 8)),
            job_id=f"m-{v}",
            content_type="image/png",
            filename=None,
            top_k=1,
            reply_to="jobs",
        )
        for v in range(5)
    ]
    await publish(names, *messages)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    await collect_results(names, 5)
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    stop.set()
    await worker
    assert 'gateway_images_classified_total{mode="offline",model="efficientnet-lite0",version="1"} 5.0' in text
    assert 'gateway_queue_messages_total{event="acked"} 5.0' in text
    assert 'gateway_queue_messages_total{event="results_published"} 5.0' in text
    assert "gateway_batch_size_count" in text


async def test_queued_time_has_millisecond_resolution(gateway_factory: MakeSettings, prefix: str) -> None:
    """`timings.queued` comes from the gateway's own `x-published-ms` header, not the AMQP timestamp
    (whole seconds): a job published 1.5 s ago by the header, within the second of its timestamp,
    is reported as queued 1.5 s and some milliseconds; a job of an earlier version (no header)
    falls back on the timestamp. Before, both read the timestamp, truncated to the second."""
    names = Names(prefix)
    settings = offline_settings(gateway_factory, prefix, backend="fake")
    published = time.time() - 1.5
    exact, old = (
        request_message(
            png_bytes(solid_image(v, 8)), job_id=name, content_type="image/png", filename=None, top_k=1, reply_to="jobs"
        )
        for v, name in ((1, "exact"), (2, "old"))
    )
    for message in (exact, old):
        message.timestamp = datetime.fromtimestamp(published, UTC)  # sent as whole seconds: int(published)
    assert exact.headers is not None
    assert old.headers is not None
    exact.headers[PUBLISHED_HEADER] = round(published * 1000)
    old.headers.pop(PUBLISHED_HEADER, None)
    await publish(names, exact, old)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    results = {r.job_id: r for r in await collect_results(names, 2)}
    stop.set()
    await worker
    now = time.time()
    assert 1.5 <= results["exact"].timings["queued"] <= now - published
    assert results["old"].timings["queued"] >= 1.5  # from the timestamp, up to 1 s more


def test_request_messages_carry_their_publish_time_in_milliseconds() -> None:
    before = round(time.time() * 1000)
    message = request_message(b"x", job_id="j", content_type="image/png", filename=None, top_k=1, reply_to="r")
    assert message.headers is not None
    assert before <= message.headers[PUBLISHED_HEADER] <= round(time.time() * 1000)
