"""Several broker addresses (the nodes of a cluster): how they are read, refused, and tried."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager

import aio_pika
import pytest
from pydantic import ValidationError
from yarl import URL

from loadtests.harness import dead_addresses
from service.errors import BackendUnavailable
from service.jobs.broker import Broker
from service.jobs.nodes import CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, Backoff, NodesConnection, addresses
from service.jobs.topology import REQUEST_KEY, Names
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL
from tests.jobs.relay import relay_to
from tests.jobs.test_api_results import _close_connection

DEAD: dict[str, Callable[[], AbstractContextManager[str]]] = {
    "refused": dead_addresses.refused,
    "blackholed": dead_addresses.blackholed,
}

pytestmark = pytest.mark.rabbitmq


def test_backoff_doubles_to_its_cap_with_jitter() -> None:
    random.seed(7)
    backoff = Backoff(first=0.5, cap=10.0)
    delays = [backoff.next() for _ in range(10)]
    for attempt, delay in enumerate(delays):
        base = min(10.0, 0.5 * 2**attempt)
        assert 0.5 * base <= delay < 1.5 * base
    assert len({round(d, 6) for d in delays}) == len(delays)  # drawn, not in step with other clients
    backoff.reset()
    assert backoff.next() < 0.75


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("http://h/", "broker address 1 of 1 is not an amqp:// or amqps:// URL"),
        ("amqp://u:pw@h1/,", "broker address 2 of 2 is empty"),
        ("amqp://h1/,,amqp://h2/", "broker address 2 of 3 is empty"),
        ("amqp://u:pw@h:99999/", "broker address 1 of 1 is not a URL"),
        ("amqp://u:pw@/", "broker address 1 of 1 has no host"),
        ("amqp://u:pw@h1/,amqp://h 2/", "broker address 2 of 2 has no host, or a space"),
        ("amqp://u:pw@h1/\n", None),  # surrounding blanks are trimmed
        (",".join(["amqp://h/"] * 17), "17 broker addresses; at most 16"),
    ],
)
def test_broker_addresses_are_checked_one_by_one_without_echoing_them(value: str, says: str | None) -> None:
    if says is None:
        assert Settings(broker_url=value).broker_url == value.strip()
        return
    with pytest.raises(ValidationError) as refused:
        Settings(broker_url=value)
    assert says in str(refused.value)
    assert "pw" not in str(refused.value)


def test_addresses_are_split_and_trimmed() -> None:
    assert addresses(" amqp://a/ , amqps://b:5671/ ") == ["amqp://a/", "amqps://b:5671/"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_dead_address_is_passed_over_for_a_live_one(prefix: str) -> None:
    """Whichever address a process starts on, it ends up connected to the one that answers."""
    dead = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/"
    for _ in range(3):  # the start is random: both orders get tried
        broker = Broker(f"{dead},{BROKER_URL}", Names(prefix))
        try:
            await broker.connect(timeout=20)
            assert broker.is_open
            assert broker.url == BROKER_URL
            assert broker.status() == "ok"
        finally:
            await broker.aclose()


async def outage_across(broker: Broker, lose: Callable[[], Awaitable[object]]) -> tuple[float, int]:
    """Publish every 10 ms while ``lose()`` runs: (seconds from the first refused publish to the
    next confirmed one, publishes refused). 0 s if none was refused."""
    loss: asyncio.Future[object] = asyncio.ensure_future(lose())
    first_refused, refused = None, 0
    async with asyncio.timeout(60):
        while True:
            try:
                await broker.publish("requests", aio_pika.Message(b"x"), REQUEST_KEY)
                if first_refused is not None:
                    await loss
                    return time.monotonic() - first_refused, refused
                if loss.done():
                    await loss
                    return 0.0, 0
            except BackendUnavailable:
                first_refused = first_refused or time.monotonic()
                refused += 1
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("loss", ["network drop", "closed by the broker"])
@pytest.mark.parametrize("dead", sorted(DEAD))
async def test_a_lost_connection_is_back_within_2_s_past_a_dead_address(prefix: str, dead: str, loss: str) -> None:
    """Two addresses, one dead (refused, or blackholed: its SYNs dropped); the connection to the
    live one is lost 4 times in a row, by a network drop (a relay resets it) or closed by the broker
    (``rabbitmqctl close_connection``), the broker staying up. Each time, publishes are confirmed
    again within 2 s, with the live address tried once (before: 11-41 s, each attempt sent to the
    dead address while the backoff grew to 10 s)."""
    live = URL(BROKER_URL)
    assert live.host is not None
    assert live.port is not None
    name = f"{prefix}.failover"
    with DEAD[dead]() as dead_url:
        async with relay_to(live.host, live.port) as (relay, port):
            broker = Broker(f"{dead_url},{live.with_port(port)}", Names(prefix), publish_timeout=2, name=name)

            async def lose() -> None:
                if loss == "network drop":
                    relay.cut()
                else:
                    await asyncio.to_thread(_close_connection, name)

            try:
                await broker.connect(timeout=20)
                assert broker.connection is not None
                restored = asyncio.Event()  # aio-pika's callback once every channel is back
                broker.connection.reconnect_callbacks.add(lambda *_: restored.set())
                outages = []
                for _ in range(4):
                    connections = relay.accepted
                    restored.clear()
                    outages.append(await outage_across(broker, lose))
                    await asyncio.wait_for(restored.wait(), 10)  # before the next loss
                    assert relay.accepted == connections + 1  # back at once on the live one
            finally:
                await broker.aclose()
    print(f"{dead}, {loss}: back after {', '.join(f'{s:.2f} s ({n} refused)' for s, n in outages)}")
    assert max(seconds for seconds, _ in outages) < 2.0, outages


async def test_a_blackholed_address_is_passed_over_in_a_fraction_of_a_second(prefix: str) -> None:
    """A TCP connect to an address that drops SYNs (a host gone from the network) is given up after
    ``CONNECT_TIMEOUT`` (a quarter of a second), not the whole attempt's 5 s: a broker given such an
    address and a live one is connected within a second, wherever it starts (4 tries)."""
    assert CONNECT_TIMEOUT <= 0.25
    with dead_addresses.blackholed() as dead:
        for _ in range(4):
            broker = Broker(f"{dead},{BROKER_URL}", Names(prefix))
            started = time.monotonic()
            try:
                await broker.connect(timeout=20)
                took = time.monotonic() - started
            finally:
                await broker.aclose()
            assert took < 1.0, f"connected after {took:.2f} s"


async def test_a_cluster_all_dead_is_not_hammered() -> None:
    """Every address refused: attempts go round the addresses without waiting, then back off
    between rounds (0.25-0.75 s, then twice that, ...), so 2 s see a handful of attempts, not a
    busy loop of connects (the waits between the addresses of a round are 0)."""
    with dead_addresses.refused() as first, dead_addresses.refused() as second:
        broker = Broker(f"{first},{second}", Names("unused"))
        broker.start()
        try:
            await asyncio.sleep(2.0)
            assert broker.connection is not None
            failures = broker.connection.failures
            assert not broker.is_open
        finally:
            await broker.aclose()
    assert 4 <= failures <= 8, failures


async def test_a_long_outage_does_not_stop_the_reconnects() -> None:
    """The counters as about 3 hours of failed rounds leave them (1,100 rounds over two addresses,
    one refused): the next round still backs off at most the backoff's cap and gives each TCP
    connect at most ``HANDSHAKE_TIMEOUT``, so the address that answers again is connected within
    seconds. Before, the doubling overflowed a float past 1,023 rounds: every attempt raised
    OverflowError before its connect, and aio-pika retried it at once, for ever (a busy loop that
    never reconnected, the broker up)."""
    with dead_addresses.refused() as dead:
        connection = NodesConnection([dead, BROKER_URL])
        connection.failures = 2 * 1100 + 1  # the dead address is the last attempt of its round
        connection.backoff = Backoff(cap=0.5, attempt=1100)  # a short cap: the test waits for it
        try:
            async with asyncio.timeout(10):
                await connection.connect(timeout=HANDSHAKE_TIMEOUT)
            assert connection.connected.is_set()
            assert connection.address == BROKER_URL
            assert connection.failures == 0
        finally:
            await connection.close()
    assert Backoff(attempt=10**6).next() < 1.5 * Backoff().cap


async def test_a_loss_while_consumers_are_restored_is_reconnected(prefix: str) -> None:
    """A consumer cancelled by the broker makes aio-pika restore the consumers on the open
    connection; a loss at that moment left the restore waiting for a reconnect only it could make
    (seen when a publish to a stream being deleted closed the connection). Here the two happen in
    that order, deterministically: the loss's first step, the recovery, then the socket closed."""
    connection = NodesConnection([BROKER_URL])
    await connection.connect(timeout=10)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"{prefix}.restore", auto_delete=True)
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            got.put_nowait(message.body)

        await queue.consume(take)
        connection.connected.clear()  # what a lost connection does first
        connection._request_recovery()  # what a consumer's cancel does
        await asyncio.sleep(0.1)  # the reconnect loop is now restoring the consumers
        assert connection.transport is not None
        await connection.transport.connection.close()
        async with asyncio.timeout(10):  # reconnected, the channel and its consumer restored
            while channel.is_closed or not connection.connected.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            await channel.default_exchange.publish(aio_pika.Message(b"after"), queue.name)
            assert await got.get() == b"after"
    finally:
        await connection.close()
