"""A replica reading the claims stream is not ready, against the real RabbitMQ: with thousands of
entries within the TTL, a new replica's /readyz is 503 naming the ``idempotency`` check until it
has read the stream up to its end, then 200; after a reconnect (the stream read again from its
start) it is 503 again until it has caught up. Its entries are acked many at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from loadtests.harness.idempotency import fill
from service.jobs.topology import Names
from service.settings import Settings
from tests.conftest import readyz_becomes, running_gateway
from tests.jobs.conftest import BROKER_URL, broker_ok
from tests.jobs.test_api_results import _close_connection

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
ENTRIES = 20_000
"""Seconds of reading for a replica (about 4,000 entries a second here), milliseconds of polling."""


async def behind(client: httpx.AsyncClient) -> httpx.Response:
    """/readyz once the replica is connected: the broker check says ok."""
    await broker_ok(client)
    return await client.get("/readyz")


async def test_a_replica_is_not_ready_until_it_has_read_the_claims_stream(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """Started with 20,000 claims entries within the TTL, a replica answers /readyz 503 with the
    ``idempotency`` check saying it is reading the stream (a load balancer sends it nothing, where
    before it was ready and answered every idempotent submit 503 until it had read them all), then
    200 once it has; a reconnect makes it read again, and not ready again until it has."""
    await fill(BROKER_URL, Names(prefix).idempotency, ENTRIES)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    async with running_gateway(settings) as client:
        first = await behind(client)
        assert first.status_code == 503, first.text
        assert first.json()["checks"]["idempotency"].startswith("reading the claims stream: ")
        assert prefix not in first.json()["checks"]["idempotency"]  # a queue's name is not for clients
        assert first.json()["checks"]["backend"].endswith("ok")

        ready = await readyz_becomes(client, 200, timeout=120)
        assert ready.json()["checks"]["idempotency"] == "ok"
        log = client.app.state.gateway.jobs.idempotency
        assert len(log.states) == ENTRIES // 2
        assert log._acks.frames <= ENTRIES // 20  # many entries per ack frame, not one each

        await asyncio.to_thread(_close_connection, f"{prefix}.api.")
        async with asyncio.timeout(60):  # not ready again once reconnected, while it reads
            while not (await client.get("/readyz")).json()["checks"]["idempotency"].startswith("reading"):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert (await client.get("/readyz")).status_code == 503
        again = await readyz_becomes(client, 200, timeout=120)
        assert again.json()["checks"]["idempotency"] == "ok"
        assert len(log.states) == ENTRIES // 2
