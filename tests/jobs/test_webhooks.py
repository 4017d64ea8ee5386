"""Completion webhooks against the real RabbitMQ and a real HTTP receiver on loopback, whose every
request is verified with the Standard Webhooks reference library (``standardwebhooks``)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from service.jobs.broker import Broker
from service.jobs.messages import DETAIL_HEADER, ERROR_HEADER, JobResult
from service.jobs.topology import Names
from service.jobs.webhooks import WebhookSender, delivery_message, signature
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from service.settings.values import parse_secret
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import (
    BROKER_URL,
    broker_ok,
    drain,
    gateway_process,
    job,
    publish,
    queue_depth,
    wait_for_line,
)
from tests.jobs.webhook_receiver import LOOPBACK, SECRET, Receiver, receiving

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]


def fails_twice(_: str, attempt: int) -> int | None:
    return 503 if attempt <= 2 else 204


def test_the_signature_is_the_reference_librarys() -> None:
    body = b'{"type":"job.done","data":{"job_id":"abc"}}'
    now = int(time.time())
    headers = {
        "webhook-id": "abc",
        "webhook-timestamp": str(now),
        "webhook-signature": signature(parse_secret(SECRET), "abc", now, body),
    }
    assert Webhook(SECRET).verify(body, headers) == json.loads(body)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(body.replace(b"abc", b"abd"), headers)
    with pytest.raises(WebhookVerificationError):  # another deployment's secret
        Webhook("whsec_" + base64.b64encode(bytes(32)).decode()).verify(body, headers)
    assert parse_secret(SECRET.removeprefix("whsec_").rstrip("=")) == parse_secret(SECRET)
    with pytest.raises(ValueError, match="at least 24"):
        parse_secret("whsec_" + base64.b64encode(bytes(16)).decode())
    with pytest.raises(ValueError, match="base64"):
        parse_secret("whsec_not base64!")


async def test_a_receiver_that_fails_twice_gets_each_job_once(gateway_factory: MakeSettings, prefix: str) -> None:
    """Through the API and a worker: each job's webhook is refused twice (503), then accepted once,
    signed, with the job's result; nothing more arrives afterwards."""
    settings = gateway_factory(
        broker_url=BROKER_URL,
        queue_prefix=prefix,
        backend="fake",
        worker_metrics_port=0,
        webhook_retry_delays="0.2,0.4",
        **LOOPBACK,
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    try:
        async with receiving(fails_twice) as receiver, running_gateway(settings) as client:
            await broker_ok(client)
            images = [("file", (f"{v}.png", png_bytes(solid_image(v, 16)), "image/png")) for v in (7, 8, 9)]
            response = await client.post("/classify?mode=offline", files=images, headers={"Webhook-URL": receiver.url})
            assert response.status_code == 202, response.text
            jobs = [job["job_id"] for job in response.json()["jobs"]]
            await receiver.until(lambda: len(receiver.accepted) == 3)
            await asyncio.sleep(1.0)  # time for any stray duplicate
            status = (await client.get(f"/jobs/{jobs[0]}")).json()
    finally:
        stop.set()
        await worker
    assert receiver.bad_signatures == 0
    assert receiver.accepted == dict.fromkeys(jobs, 1)
    assert receiver.attempts == dict.fromkeys(jobs, 3)
    for job_id, value in zip(jobs, (7, 8, 9), strict=True):
        payload = receiver.payloads[job_id]
        assert payload["type"] == "job.done"
        result = JobResult.model_validate(payload["data"])
        assert result.job_id == job_id
        assert result.filename == f"{value}.png"
        assert result.labels[0].index == value  # the fake backend's class is the red value
    assert status["status"] == "done"


async def test_the_api_refuses_webhooks_it_must_not_call(gateway_factory: MakeSettings, prefix: str) -> None:
    names = Names(prefix)
    base = {"broker_url": BROKER_URL, "queue_prefix": prefix, "backend": "fake"}
    image = [("file", ("a.png", png_bytes(solid_image(5, 16)), "image/png"))]

    async def submit(client: httpx.AsyncClient, url: str, **headers: str) -> httpx.Response:
        return await client.post("/classify?mode=offline", files=image, headers={"Webhook-URL": url, **headers})

    async with running_gateway(gateway_factory(**base)) as client:
        off = await submit(client, "https://example.com/hook")
        assert off.status_code == 400
        assert "GATEWAY_WEBHOOK_SECRET" in off.json()["detail"]
    strict = gateway_factory(**base, webhook_secret=SECRET)
    async with running_gateway(strict) as client:
        for url, status, error, words in [
            ("http://example.com/hook", 403, "url_not_allowed", "only https"),
            ("ftp://example.com/hook", 400, "bad_request", "scheme 'ftp'"),
            ("https://127.0.0.1/hook", 403, "url_not_allowed", "loopback"),
            ("https://169.254.169.254/latest", 403, "url_not_allowed", "link-local"),
            ("https://[::ffff:10.0.0.1]/hook", 403, "url_not_allowed", "private"),
            ("https://localhost/hook", 403, "url_not_allowed", "loopback"),
            ("https://no-such-host.invalid/hook", 400, "bad_request", "cannot be resolved"),
            ("https://user:pw@example.com/hook", 400, "bad_request", "credentials"),
            ("https://example.com/" + "a" * 3000, 400, "bad_request", "at most 2048"),
        ]:
            refused = await submit(client, url)
            assert refused.status_code == status, (url, refused.text)
            assert refused.json()["error"] == error
            assert words in refused.json()["detail"], refused.text
            assert refused.json()["detail"].startswith("Webhook-URL")
        online = await client.post("/classify", files=image, headers={"Webhook-URL": "https://example.com/hook"})
        assert online.status_code == 400
        assert "mode=offline" in online.json()["detail"]
        assert await queue_depth(names.work) == 0  # nothing refused was queued
        operation = (await client.get("/openapi.json")).json()["paths"]["/classify"]["post"]
        (documented,) = [p for p in operation["parameters"] if p["name"] == "Webhook-URL"]
        assert documented["in"] == "header"
        assert "webhook-signature" in documented["description"]
        assert "Webhook-URL" in operation["responses"]["403"]["description"]
    async with running_gateway(gateway_factory(**base, **LOOPBACK)) as client:
        await broker_ok(client)
        first = await submit(client, "http://127.0.0.1:9/a", **{"Idempotency-Key": "k1"})
        assert first.status_code == 202, first.text
        other = await submit(client, "http://127.0.0.1:9/b", **{"Idempotency-Key": "k1"})
        assert other.status_code == 409  # another webhook is another request
        (message,) = await drain(names.work)
        assert message.headers["x-webhook-url"] == "http://127.0.0.1:9/a"


@asynccontextmanager
async def sender(make: MakeSettings, prefix: str, **overrides: Any) -> AsyncIterator[tuple[WebhookSender, Broker]]:
    settings = make(broker_url=BROKER_URL, queue_prefix=prefix, **{**LOOPBACK, **overrides})
    broker = Broker(BROKER_URL, Names(prefix))
    await broker.connect(timeout=10)
    webhooks = WebhookSender(settings, broker, Metrics())
    await webhooks.start()
    try:
        yield webhooks, broker
    finally:
        await webhooks.stop(drain_timeout=2)
        await broker.aclose()


def finished(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, status="done")


async def test_a_delivery_no_receiver_accepts_is_dead_lettered(gateway_factory: MakeSettings, prefix: str) -> None:
    """500 for ever: retried until the max age, then undeliverable; 410: undeliverable at once."""
    names = Names(prefix)

    def decide(webhook_id: str, _: int) -> int:
        return 410 if webhook_id == "gone" else 500

    async with (
        receiving(decide) as receiver,
        sender(gateway_factory, prefix, webhook_retry_delays="0.1,0.2", webhook_max_age=1.5) as (webhooks, broker),
    ):
        for job_id in ("down", "gone"):
            await broker.publish("queue", delivery_message(finished(job_id), receiver.url), names.webhooks)
        async with asyncio.timeout(30):
            while await queue_depth(names.dead) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        dead = {m.message_id: m for m in await drain(names.dead)}
        metrics = webhooks.metrics
    assert receiver.accepted == {}
    assert receiver.attempts["gone"] == 1
    assert 4 <= receiver.attempts["down"] <= 12  # 0.1, 0.2, 0.2, ... s apart within 1.5 s
    for message in dead.values():
        assert message.headers[ERROR_HEADER] == "webhook_undeliverable"
        assert message.headers["x-webhook-url"] == receiver.url
    assert "410 Gone" in str(dead["gone"].headers[DETAIL_HEADER])
    assert "answered 500" in str(dead["down"].headers[DETAIL_HEADER])
    assert json.loads(dead["down"].body)["data"]["job_id"] == "down"
    assert metrics.webhook_deliveries.labels("undeliverable")._value.get() == 2
    assert metrics.webhook_deliveries.labels("retried")._value.get() == receiver.attempts["down"] - 1
    assert metrics.webhook_deliveries.labels("delivered")._value.get() == 0


async def test_a_delivery_whose_counts_are_out_of_range_is_given_up(gateway_factory: MakeSettings, prefix: str) -> None:
    """Deliveries whose ``x-webhook-attempts`` is negative, or whose ``x-webhook-since`` is far in
    the future, to a receiver that answers 500: each is undeliverable at once, its reason naming
    the header, never POSTed. Before, a negative count picked a delay from the end of the list or
    failed at every attempt (requeued at once, for ever), and a future start made the delivery's age
    negative, so it was retried past ``GATEWAY_WEBHOOK_MAX_AGE`` for ever."""
    names = Names(prefix)
    forged = {
        "negative": ("x-webhook-attempts", -1000),
        "future": ("x-webhook-since", int(time.time() * 1000) + 10**12),
    }
    async with (
        receiving(lambda *_: 500) as receiver,
        sender(gateway_factory, prefix, webhook_retry_delays="0.1,0.2", webhook_max_age=1.5) as (_, broker),
    ):
        for job_id, (header, value) in forged.items():
            message = delivery_message(finished(job_id), receiver.url)
            assert message.headers is not None
            message.headers[header] = value
            await broker.publish("queue", message, names.webhooks)
        async with asyncio.timeout(10):
            while await queue_depth(names.dead) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        dead = {m.message_id: m for m in await drain(names.dead)}
    assert receiver.attempts == {}
    for job_id, (header, _) in forged.items():
        assert dead[job_id].headers[ERROR_HEADER] == "webhook_undeliverable"
        assert f"bad message header: {header}=" in str(dead[job_id].headers[DETAIL_HEADER])


async def test_the_sender_checks_the_address_it_connects_to(gateway_factory: MakeSettings, prefix: str) -> None:
    """A delivery whose host resolves to loopback, with no allowlist: never connected to, dead-lettered
    (a message does not have to come from an API that checked it)."""
    names = Names(prefix)
    async with (
        receiving(lambda *_: 204, host="localhost") as receiver,
        sender(gateway_factory, prefix, webhook_allowlist="") as (_, broker),
    ):
        await broker.publish("queue", delivery_message(finished("sneaky"), receiver.url), names.webhooks)
        async with asyncio.timeout(30):
            while await queue_depth(names.dead) < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        (dead,) = await drain(names.dead)
    assert receiver.attempts == {}
    assert "loopback" in str(dead.headers[DETAIL_HEADER])


def test_deliveries_survive_a_worker_sigkill(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """Each job's webhook is refused once (500: it waits in a retry queue), then held without an
    answer while the worker is SIGKILLed mid-request; a new worker delivers it. Each job is
    accepted exactly once."""
    names = Names(prefix)

    def decide(_: str, attempt: int) -> int | None:
        return {1: 500, 2: None}.get(attempt, 200)

    async def scenario() -> Receiver:
        async with receiving(decide) as receiver:
            env = {
                **os.environ,
                "GATEWAY_BROKER_URL": BROKER_URL,
                "GATEWAY_QUEUE_PREFIX": prefix,
                "GATEWAY_BACKEND": "fake",
                "GATEWAY_WORKER_METRICS_PORT": "0",
                "GATEWAY_MODELS_DIR": str(models_dir),
                "GATEWAY_WEBHOOK_SECRET": SECRET,
                "GATEWAY_WEBHOOK_ALLOW_HTTP": "true",
                "GATEWAY_WEBHOOK_ALLOWLIST": "127.0.0.1/32",
                "GATEWAY_WEBHOOK_RETRY_DELAYS": "0.3",
                "GATEWAY_WEBHOOK_TIMEOUT": "60",
            }
            jobs = [f"job-{i}" for i in range(4)]
            messages = [job(i, job_id, webhook=receiver.url) for i, job_id in enumerate(jobs)]
            await publish(names, *messages)
            first = gateway_process(["worker"], env, tmp_path / "worker-1.log")
            try:
                await receiver.until(lambda: all(receiver.attempts[j] == 2 for j in jobs))
            finally:
                first.send_signal(signal.SIGKILL)
                first.wait()
            second = gateway_process(["worker"], env, tmp_path / "worker-2.log")
            try:
                await asyncio.to_thread(wait_for_line, tmp_path / "worker-2.log", "worker ready")
                await receiver.until(lambda: len(receiver.accepted) == len(jobs))
                await asyncio.sleep(1.0)  # time for any stray duplicate
            finally:
                second.send_signal(signal.SIGTERM)
                second.wait(timeout=30)
            assert receiver.accepted == dict.fromkeys(jobs, 1)
            assert receiver.attempts == dict.fromkeys(jobs, 3)
            assert receiver.bad_signatures == 0
            assert await queue_depth(names.webhooks) == 0
            return receiver

    asyncio.run(scenario())
