"""The broker connection's set-up (real RabbitMQ): what ``on_connect`` sets up (the API's result
and idempotency consumers) is part of being connected."""

from __future__ import annotations

import asyncio

import pytest

from service.jobs.broker import Broker
from service.jobs.topology import Names
from tests.jobs.conftest import BROKER_URL

pytestmark = pytest.mark.rabbitmq


async def test_not_ok_until_its_consumers_are_set_up_and_a_failed_set_up_is_retried(prefix: str) -> None:
    """Two API replicas starting together once crashed one's stream consume (RabbitMQ closed its
    connection) after /readyz had said ok, and a submit then got 503: readiness now waits for
    ``on_connect``, and its failure closes that connection and connects again."""
    gate = asyncio.Event()
    calls: list[bool] = []

    async def on_connect(broker: Broker) -> None:
        calls.append(broker.is_open)
        if len(calls) == 1:
            raise RuntimeError("consume refused")
        await gate.wait()

    broker = Broker(BROKER_URL, Names(prefix), on_connect=on_connect)
    broker.start()
    try:
        async with asyncio.timeout(10):
            while len(calls) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert calls == [False, False]  # never open while setting up
        assert broker.status() != "ok"
        gate.set()
        async with asyncio.timeout(10):
            await broker.connected.wait()
        assert broker.status() == "ok"
    finally:
        await broker.aclose()
