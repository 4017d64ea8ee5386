"""A connection to RabbitMQ that the API can hold while the broker is down.

``connect_robust`` only reconnects after a first success, so the first connection is retried here
in the background; until it exists, and whenever it is lost, ``publish`` fails at once with 503
rather than hanging. Publishes use publisher confirms and ``mandatory``, with a timeout; the channel
is opened with aio-pika's ``on_return_raises``, so a publish the broker returns as unroutable fails
(``PublishError``) like a nacked one instead of counting as confirmed.

With several addresses (the nodes of a cluster, comma-separated in ``GATEWAY_BROKER_URL``) each
process starts on one picked at random, so that clients spread over the nodes, and when its node is
lost, every reconnection attempt of aio-pika's robust connection goes to the next address: the
connection, its channels, queues and consumers are restored there as they would be on the same node.
Attempts back off exponentially with jitter (``Backoff``), so that the clients of a dead node do not
all arrive at the next one at the same instant.

Publishes go on a channel of their own, not the consumers' channel (RabbitMQ's advice: publishing
and consuming apart). A channel whose publish was nacked is retired and the next publish opens a
new one: after a node's loss, a channel opened on a surviving node before the new quorum queue
leader is known there (RabbitMQ 3.10 reads the leader from a record that can be stale; later
versions ask the election's own table) nacks every publish to that queue for as long as it lives,
while a channel opened a moment later works. Retiring costs a channel open, at most once a second
(a queue that refuses every message, ``reject-publish``, must not make a channel per nack: the
connection's ``channel_max`` would run out and the broker close it, consumers and all); closing the
consumers' channel instead would lose its deliveries' tags.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractMessage, AbstractRobustChannel, AbstractRobustConnection
from pamqp.common import FieldTable
from yarl import URL

from service.errors import BackendUnavailable
from service.jobs import frames
from service.jobs.topology import Names, Route, Topology, declare

logger = logging.getLogger(__name__)

RETIRE_INTERVAL = 1.0
"""Seconds between two retirements of the publisher channel (see ``Broker._retire``)."""


def addresses(url: str) -> list[str]:
    """The broker addresses of a ``GATEWAY_BROKER_URL``: one URL, or several comma-separated."""
    return [part.strip() for part in url.split(",") if part.strip()]


@dataclass
class Backoff:
    """Seconds before the next connection attempt: doubling from ``first`` up to ``cap``, each drawn
    from [0.5, 1.5) of that ("equal jitter"), so that many clients spread out instead of retrying in
    step."""

    first: float = 0.5
    cap: float = 10.0
    attempt: int = 0

    def next(self) -> float:
        base = min(self.cap, self.first * 2**self.attempt)
        self.attempt += 1
        return float(base * random.uniform(0.5, 1.5))

    def reset(self) -> None:
        self.attempt = 0


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if scheme else f"{user}:***@{host}"


class Broker:
    def __init__(
        self,
        url: str,
        names: Names,
        *,
        publish_timeout: float = 5.0,
        prefetch: int = 0,
        on_connect: Callable[[Broker], Awaitable[None]] | None = None,
        name: str | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        frames.install()  # a message with hostile properties must not close the connection
        self.addresses = addresses(url)
        if not self.addresses:
            raise ValueError("no broker address")
        self._current = random.randrange(len(self.addresses))
        self._backoff = Backoff()
        self.names = names
        self.publish_timeout = publish_timeout
        self.prefetch = prefetch
        self._on_connect = on_connect
        self.routes = tuple(routes)
        """The models' work queues declared besides ``<prefix>.work`` (``service.jobs.topology``)."""
        self.name = name
        """Connection name shown by RabbitMQ (management UI, ``rabbitmqctl list_connections``)."""
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractRobustChannel | None = None
        self.topology: Topology | None = None
        self._connector: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._publisher: AbstractChannel | None = None
        """The channel publishes go on (opened on first use, replaced once it nacks)."""
        self._publisher_lock = asyncio.Lock()
        self._retired: set[asyncio.Task[None]] = set()
        self._retired_at = float("-inf")
        self.publishers_opened = 0
        """Publisher channels opened: the first, and one after each nack (for tests and logs)."""
        self._closing = False
        self.connected = asyncio.Event()

    @property
    def url(self) -> str:
        """The address in use (or tried next)."""
        return self.addresses[self._current]

    def _rotate(self) -> str:
        self._current = (self._current + 1) % len(self.addresses)
        return self.url

    async def _connect_once(self) -> None:
        properties: FieldTable | None = {"connection_name": self.name} if self.name else None
        connection = await aio_pika.connect_robust(
            self.url, timeout=5, reconnect_interval=self._backoff.first, client_properties=properties
        )
        if len(self.addresses) > 1:
            connection.close_callbacks.add(self._on_lost)
            connection.reconnect_callbacks.add(self._on_restored)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.prefetch:
                await channel.set_qos(prefetch_count=self.prefetch)
            self.topology = await declare(connection, channel, self.names, self.routes)
            self.connection, self.channel = connection, channel
            if self._on_connect is not None:  # its consumers are part of being connected
                await self._on_connect(self)
        except BaseException:  # a failed set-up must not leave a connection behind per retry
            self.connection = self.channel = None
            await connection.close()
            raise
        self.connected.set()
        self._backoff.reset()
        logger.info("broker: connected to %s", redact(self.url))

    def _on_lost(self, connection: Any, exc: BaseException | None = None) -> None:
        """The node is gone (or the link to it): aim the robust connection's attempts elsewhere.
        Called before aio-pika's first attempt, so that attempt already goes to the next node; a
        follower keeps moving on while the attempts fail."""
        if self._closing or self.connection is None or connection is not self.connection:
            return  # closed on purpose, or not ours
        logger.warning("broker: lost %s (%s); trying %s", redact(self.url), exc, redact(self._rotate()))
        self._aim(self.connection)
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._fail_over(self.connection))

    def _on_restored(self, connection: Any) -> None:
        self._backoff.reset()
        logger.info("broker: reconnected to %s", redact(self.url))

    def _aim(self, connection: AbstractRobustConnection) -> None:
        connection.url = URL(self.url)  # type: ignore[attr-defined]  # read by each attempt
        connection.reconnect_interval = self._backoff.next()  # type: ignore[attr-defined]

    async def _fail_over(self, connection: AbstractRobustConnection) -> None:
        """While the robust connection is down, move it on to the next address after each interval."""
        while not connection.is_closed:
            await asyncio.sleep(connection.reconnect_interval)  # type: ignore[attr-defined]
            if connection.connected.is_set() or connection.is_closed:
                return
            self._rotate()
            self._aim(connection)

    async def _connect_forever(self) -> None:
        while True:
            try:
                await self._connect_once()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = self._backoff.next()
                tried = redact(self.url)
                logger.warning(
                    "broker: cannot connect to %s (%s); trying %s in %.1f s", tried, exc, redact(self._rotate()), delay
                )
                await asyncio.sleep(delay)

    def start(self) -> None:
        """Connect in the background (the caller does not wait for the broker)."""
        self._connector = asyncio.create_task(self._connect_forever(), name="broker-connect")

    async def connect(self, timeout: float | None = None) -> None:
        """Connect and wait for it (worker, ingest)."""
        self.start()
        async with asyncio.timeout(timeout):
            await self.connected.wait()

    @property
    def is_open(self) -> bool:
        """Connected and set up (``on_connect`` done): until then /readyz does not say ok, and
        publishes are refused."""
        return (
            self.connected.is_set()
            and self.connection is not None
            and not self.connection.is_closed
            and self.channel is not None
            and not self.channel.is_closed
        )

    def status(self) -> str:
        """For /readyz and the 503 of a submit: no address in it (the log's warnings name them)."""
        if self.is_open:
            return "ok"
        if len(self.addresses) > 1:
            return f"not connected to any of {len(self.addresses)} broker nodes"
        return "not connected to the broker"

    async def publish(
        self,
        target: Literal["requests", "results", "dead", "queue"],
        message: AbstractMessage,
        routing_key: str,
    ) -> None:
        """Publish to one of the topology's exchanges (``queue``: straight to the queue named by
        ``routing_key``) with confirm; 503 at once when disconnected, or after ``publish_timeout``
        without a confirm."""
        if not self.is_open or self.topology is None or self.channel is None:
            raise BackendUnavailable(f"the message broker is unreachable ({self.status()})")
        exchange_name = {
            "requests": self.topology.requests_exchange.name,
            "results": self.topology.results_exchange.name,
            "dead": self.topology.dead_exchange.name,
            "queue": "",
        }[target]
        channel = None
        try:
            async with asyncio.timeout(self.publish_timeout):
                channel = await self._publisher_channel()
                exchange = await channel.get_exchange(exchange_name, ensure=False) if exchange_name else None
                await (exchange or channel.default_exchange).publish(message, routing_key, mandatory=True)
        # The queue's name and the broker's words (which name queues) are for the log only
        except aio_pika.exceptions.PublishError as exc:  # returned: no queue is bound for it
            logger.warning("broker: a message to %r was returned unroutable: %s", routing_key, exc)
            raise BackendUnavailable("the broker could not route the message to its queue") from exc
        except aio_pika.exceptions.DeliveryError as exc:  # nacked: a queue refused it (full, stale, ...)
            self._retire(channel)
            logger.warning("broker: a message to %r was refused: %s", routing_key, exc)
            raise BackendUnavailable("the broker refused the message (its queue is full or gone)") from exc
        except (TimeoutError, aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            logger.warning("broker: a message to %r was not confirmed: %s: %s", routing_key, type(exc).__name__, exc)
            raise BackendUnavailable(f"the broker did not confirm the message ({type(exc).__name__})") from exc

    async def _publisher_channel(self) -> AbstractChannel:
        """The channel publishes go on; opened (with confirms, unroutable messages raising) when
        there is none or it was retired. A robust channel: restored with the connection."""
        async with self._publisher_lock:
            if self._publisher is not None and self._publisher.is_closed:
                # closed by the server (a channel error): closed for good here too, or the robust
                # channel would reopen itself beside its replacement and stay open unused
                self._close_later(self._publisher, 0.0)
                self._publisher = None
            if self._publisher is None:
                assert self.connection is not None
                self._publisher = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
                self.publishers_opened += 1
            return self._publisher

    def _retire(self, channel: AbstractChannel | None) -> None:
        """A channel nacked a publish: the next publish opens another (at most one retirement per
        ``RETIRE_INTERVAL``, so a queue that refuses everything cannot make a channel per nack). It
        is closed once the publishes still awaiting its confirms had time to get them."""
        if channel is None or channel is not self._publisher:
            return  # already retired by another nack
        now = asyncio.get_running_loop().time()
        if now - self._retired_at < RETIRE_INTERVAL:
            return
        self._retired_at = now
        self._publisher = None
        logger.info("broker: a publish was nacked; later publishes go on a new channel")
        self._close_later(channel, self.publish_timeout)

    def _close_later(self, channel: AbstractChannel, delay: float) -> None:
        async def close() -> None:
            await asyncio.sleep(delay)
            with suppress(Exception):
                await channel.close()

        task = asyncio.get_running_loop().create_task(close())
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def aclose(self) -> None:
        self._closing = True
        for task in (self._connector, self._follower, *self._retired):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.connection is not None:
            await self.connection.close()
