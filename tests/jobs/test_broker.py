"""The broker connection's set-up (real RabbitMQ): what ``on_connect`` sets up (the API's result
and idempotency consumers) is part of being connected."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from service.errors import BackendUnavailable
from service.jobs.broker import RETIRE_INTERVAL, Broker
from service.jobs.topology import REQUEST_KEY, Names
from tests.jobs.conftest import BROKER_URL, queue_depth

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


async def test_a_nacked_publish_retires_its_channel_and_the_next_goes_on_a_new_one(prefix: str) -> None:
    """A channel that nacked is not trusted again (on RabbitMQ 3.10 such a channel kept nacking a
    quorum queue whose leader it had wrong): the publish fails with 503, the next publish opens a
    new channel, and the consumers' channel is left alone."""
    names = Names(prefix)
    full = f"{prefix}.full"
    broker = Broker(BROKER_URL, names, publish_timeout=5)
    await broker.connect(timeout=10)
    try:
        assert broker.channel is not None
        consumers = broker.channel
        # a queue that refuses every message: publishes to it are nacked
        await broker.channel.declare_queue(full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
        with pytest.raises(BackendUnavailable, match="refused"):
            await broker.publish("queue", aio_pika.Message(b"refused"), full)
        assert broker.publishers_opened == 1
        await broker.publish("queue", aio_pika.Message(b"job", delivery_mode=2), names.work)
        assert broker.publishers_opened == 2  # the nacking channel was replaced
        await broker.publish("queue", aio_pika.Message(b"job", delivery_mode=2), names.work)
        assert broker.publishers_opened == 2  # a confirmed publish keeps its channel
        assert broker.channel is consumers
        assert not consumers.is_closed
        assert await queue_depth(names.work) == 2
        # a queue that refuses everything: at most one new channel a second, never one per nack
        # (2,047 nacks in 5 s once ran out the connection's channels and it was closed)
        started = asyncio.get_running_loop().time()
        for _ in range(300):
            with pytest.raises(BackendUnavailable, match="refused"):
                await broker.publish("queue", aio_pika.Message(b"refused"), full)
        seconds = asyncio.get_running_loop().time() - started
        assert broker.publishers_opened <= 2 + int(seconds / RETIRE_INTERVAL) + 1
        assert broker.is_open
        await broker.publish("requests", aio_pika.Message(b"job", delivery_mode=2), REQUEST_KEY)
        assert await queue_depth(names.work) == 3
    finally:
        await broker.aclose()  # the prefix fixture deletes the queues


async def test_a_publish_to_a_deleted_exchange_costs_no_other_publish_its_confirm(prefix: str) -> None:
    """An exchange deleted under a running gateway (by an operator, or a cleanup): the broker closes
    the channel that a publish to it went on, and every publish still awaiting its confirm on that
    channel failed with it, routed or not. A worker's result was one (the job was requeued and run
    again: its result arrived twice). Each exchange's publishes go on a channel of their own."""
    names = Names(prefix)
    broker = Broker(BROKER_URL, names, publish_timeout=5)
    await broker.connect(timeout=10)
    try:
        connection = await aio_pika.connect(BROKER_URL)
        async with connection:
            await (await connection.channel()).exchange_delete(names.notices)
        for _ in range(20):
            job, notice = await asyncio.gather(
                broker.publish("requests", aio_pika.Message(b"job", delivery_mode=2), REQUEST_KEY),
                broker.publish("notices", aio_pika.Message(b"notice"), "notice"),
                return_exceptions=True,
            )
            assert job is None
            assert isinstance(notice, BackendUnavailable)
        assert broker.is_open
        assert await queue_depth(names.work) == 20
    finally:
        await broker.aclose()
