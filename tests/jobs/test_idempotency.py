"""Idempotent offline submits against the real RabbitMQ: a retry with the same Idempotency-Key and
body gets the same job ids and queues nothing new, on the replica that took it, on another one,
and on one started afterwards; another body is 409; a partly failed submit is safe to retry."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.errors import BackendUnavailable
from service.jobs.client import JobsClient, OfflineImage
from service.jobs.topology import Names
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, broker_ok, queue_depth

MakeSettings = Callable[..., Settings]
PNGS = [png_bytes(solid_image(v, 16)) for v in (10, 20, 30)]


def files(images: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("file", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]


async def submit(client: httpx.AsyncClient, key: str | None, images: list[bytes]) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await client.post("/classify?mode=offline", files=files(images), headers=headers)


def ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 202, response.text
    return [job["job_id"] for job in response.json()["jobs"]]


async def test_a_retry_anywhere_gets_the_same_jobs_and_queues_nothing(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    names = Names(prefix)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    async with running_gateway(settings) as first, running_gateway(settings) as second:
        await broker_ok(first)
        await broker_ok(second)
        accepted = await submit(first, "order-1234", PNGS[:2])
        assert "idempotent-replayed" not in accepted.headers
        jobs = ids(accepted)
        again = await submit(first, "order-1234", PNGS[:2])
        assert ids(again) == jobs
        assert again.headers["idempotent-replayed"] == "true"
        # the claim reaches the other replica through the stream: milliseconds, but on a loaded
        # 2-core CI machine once over 0.3 s (a fixed sleep failed there)
        idempotency = second.app.state.gateway.jobs.idempotency
        async with asyncio.timeout(10):
            while idempotency.get("", "order-1234") is None:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        elsewhere = await submit(second, "order-1234", PNGS[:2])
        assert ids(elsewhere) == jobs
        assert elsewhere.headers["idempotent-replayed"] == "true"
        assert await queue_depth(names.work) == 2

        conflict = await submit(second, "order-1234", PNGS[1:3])
        assert conflict.status_code == 409
        assert conflict.json()["error"] == "idempotency_conflict"
        renamed = await first.post(
            "/classify?mode=offline",
            files=[("file", ("other-name.png", PNGS[0], "image/png")), ("file", ("1.png", PNGS[1], "image/png"))],
            headers={"Idempotency-Key": "order-1234"},
        )
        assert renamed.status_code == 409  # the filenames are part of the body

        # two retries at once on one replica: one publishes, the other waits and replays
        together = await asyncio.gather(submit(first, "order-5678", PNGS), submit(first, "order-5678", PNGS))
        assert ids(together[0]) == ids(together[1])
        assert await queue_depth(names.work) == 5

        plain = [ids(await submit(first, None, PNGS[:1])) for _ in range(2)]
        assert plain[0] != plain[1]  # without a key, every submit is new
        assert await queue_depth(names.work) == 7

        bad = await submit(first, "has spaces in it", PNGS[:1])
        assert bad.status_code == 400
        assert "Idempotency-Key" in bad.json()["detail"]
        assert (await submit(first, "k" * 256, PNGS[:1])).status_code == 400

    # a replica started afterwards reads the claims from the stream's start
    async with running_gateway(settings) as late:
        await broker_ok(late)
        await asyncio.sleep(0.3)
        assert ids(await submit(late, "order-1234", PNGS[:2])) == jobs
        assert await queue_depth(names.work) == 7


async def test_the_same_key_under_two_api_keys_is_two_submits(gateway_factory: MakeSettings, prefix: str) -> None:
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake", api_keys="tenant-a,tenant-b")
    async with running_gateway(settings) as client:
        await broker_ok(client)
        a = await client.post(
            "/classify?mode=offline", files=files(PNGS[:1]), headers={"Idempotency-Key": "1", "x-api-key": "tenant-a"}
        )
        b = await client.post(
            "/classify?mode=offline", files=files(PNGS[1:2]), headers={"Idempotency-Key": "1", "x-api-key": "tenant-b"}
        )
        assert ids(a) != ids(b)  # and no 409: keys are per API key
    assert await queue_depth(Names(prefix).work) == 2


async def test_a_partly_failed_submit_publishes_only_the_rest_when_retried(prefix: str) -> None:
    client = JobsClient(Settings(broker_url=BROKER_URL, queue_prefix=prefix), Metrics())
    await client.broker.connect(timeout=30)
    real_publish = client.broker.publish
    requests_published = 0

    async def failing_on_the_second(target: Any, message: Any, routing_key: str) -> None:
        nonlocal requests_published
        if target == "requests":
            requests_published += 1
            if requests_published == 2:
                raise BackendUnavailable("the broker did not confirm the message (simulated)")
        await real_publish(target, message, routing_key)

    images = [OfflineImage(data, "image/png", f"{i}.png") for i, data in enumerate(PNGS)]
    try:
        client.broker.publish = failing_on_the_second  # type: ignore[method-assign]
        with pytest.raises(BackendUnavailable):
            await client.submit(images, 5, ("", "batch-9"))
        assert await queue_depth(Names(prefix).work) == 2  # the first and third were confirmed
        client.broker.publish = real_publish  # type: ignore[method-assign]
        retried = await client.submit(images, 5, ("", "batch-9"))
        assert not retried.replayed  # it published the one the first attempt did not
        assert await queue_depth(Names(prefix).work) == 3
        replayed = await client.submit(images, 5, ("", "batch-9"))
        assert replayed.replayed
        assert replayed.job_ids == retried.job_ids
        assert len(set(retried.job_ids)) == 3
        assert await queue_depth(Names(prefix).work) == 3
    finally:
        await client.aclose()
