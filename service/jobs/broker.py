"""A connection to RabbitMQ that the API can hold while the broker is down.

The connection is made in the background, and aio-pika's robust connection retries the first
attempt as it retries after a loss; until it is set up, and whenever it is lost, ``publish`` fails
at once with 503 rather than hanging. Publishes use publisher confirms and ``mandatory``, with a timeout; the channel
is opened with aio-pika's ``on_return_raises``, so a publish the broker returns as unroutable fails
(``PublishError``) like a nacked one instead of counting as confirmed.

With several addresses (the nodes of a cluster, comma-separated in ``GATEWAY_BROKER_URL``) each
process starts on one picked at random, so that clients spread over the nodes; the connection is a
``service.jobs.nodes.NodesConnection``, aio-pika's robust connection whose reconnect loop takes each
attempt to the next address (passing a dead one in well under a second) and backs off only once
every address has failed: the connection, its channels, queues and consumers are restored on the
node it reaches as they would be on the same node.

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
from typing import Literal

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractMessage, AbstractRobustChannel
from pamqp.common import FieldTable

from service.errors import BackendUnavailable
from service.jobs import frames
from service.jobs.nodes import HANDSHAKE_TIMEOUT, Backoff, NodesConnection, addresses
from service.jobs.topology import Names, Route, Topology, declare
from service.settings.values import redact

logger = logging.getLogger(__name__)

RETIRE_INTERVAL = 1.0
"""Seconds between two retirements of the publisher channel (see ``Broker._retire``)."""


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
        self._start = random.randrange(len(self.addresses))
        self.names = names
        self.publish_timeout = publish_timeout
        self.prefetch = prefetch
        self._on_connect = on_connect
        self.routes = tuple(routes)
        """The models' work queues declared besides ``<prefix>.work`` (``service.jobs.topology``)."""
        self.name = name
        """Connection name shown by RabbitMQ (management UI, ``rabbitmqctl list_connections``)."""
        self.connection: NodesConnection | None = None
        self.channel: AbstractRobustChannel | None = None
        self.topology: Topology | None = None
        self._connector: asyncio.Task[None] | None = None
        self._publishers: dict[str, AbstractChannel] = {}
        """The channel each exchange's publishes go on, by exchange name ("": the default exchange):
        opened on first use, replaced once it nacks or the broker closes it. One per exchange, because
        the broker closes a channel that publishes to a missing exchange, and every publish awaiting
        its confirm there fails with it, routed or not (a worker's result, run again for it)."""
        self._publisher_lock = asyncio.Lock()
        self._retired: set[asyncio.Task[None]] = set()
        self._retired_at: dict[str, float] = {}
        self.publishers_opened = 0
        """Publisher channels opened: the first of each exchange, and one after each nack (for tests
        and logs)."""
        self.connected = asyncio.Event()

    @property
    def url(self) -> str:
        """The address in use (or tried next)."""
        return self.connection.address if self.connection is not None else self.addresses[self._start]

    async def _set_up(self, connection: NodesConnection) -> None:
        """The consumers' channel, the topology and ``on_connect``'s consumers, on a new connection."""
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.prefetch:
                await channel.set_qos(prefetch_count=self.prefetch)
            self.topology = await declare(connection, channel, self.names, self.routes)
            self.channel = channel
            if self._on_connect is not None:  # its consumers are part of being connected
                await self._on_connect(self)
        except BaseException:
            self.channel = None
            raise
        self.connected.set()
        # the address itself (a host of the network inside) only at debug: info lines reach shared logs
        logger.info("broker: connected to address %d of %d", self.addresses.index(self.url) + 1, len(self.addresses))
        logger.debug("broker: connected to %s", redact(self.url))

    async def _connect_forever(self) -> None:
        """Connect (the connection itself tries every address in turn until one answers), then set
        up; a set-up that fails closes that connection and starts again after a backoff, from the
        address the connection would have tried next."""
        properties: FieldTable | None = {"connection_name": self.name} if self.name else None
        start, backoff = self._start, Backoff()
        while True:
            connection = NodesConnection(self.addresses, start=start, client_properties=properties)
            self.connection = connection  # status() names the address it tries
            try:
                await connection.connect(timeout=HANDSHAKE_TIMEOUT)
                await self._set_up(connection)
                return
            except BaseException as exc:  # a failed set-up must not leave a connection behind per retry
                self.connection = None
                await connection.close()
                if not isinstance(exc, Exception):
                    raise
                delay = backoff.next()
                logger.warning(
                    "broker: cannot set up on %s (%s); again in %.1f s", redact(connection.address), exc, delay
                )
                start = connection.current + 1
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
        target: Literal["requests", "results", "dead", "notices", "queue"],
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
            "notices": self.topology.notices_exchange.name,
            "queue": "",
        }[target]
        channel = None
        try:
            async with asyncio.timeout(self.publish_timeout):
                channel = await self._publisher_channel(exchange_name)
                exchange = await channel.get_exchange(exchange_name, ensure=False) if exchange_name else None
                await (exchange or channel.default_exchange).publish(message, routing_key, mandatory=True)
        # The queue's name and the broker's words (which name queues) are for the log only
        except aio_pika.exceptions.PublishError as exc:  # returned: no queue is bound for it
            logger.warning("broker: a message to %r was returned unroutable: %s", routing_key, exc)
            raise BackendUnavailable("the broker could not route the message to its queue") from exc
        except aio_pika.exceptions.DeliveryError as exc:  # nacked: a queue refused it (full, stale, ...)
            self._retire(exchange_name, channel)
            logger.warning("broker: a message to %r was refused: %s", routing_key, exc)
            raise BackendUnavailable("the broker refused the message (its queue is full or gone)") from exc
        except (TimeoutError, aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            logger.warning("broker: a message to %r was not confirmed: %s: %s", routing_key, type(exc).__name__, exc)
            raise BackendUnavailable(f"the broker did not confirm the message ({type(exc).__name__})") from exc

    async def _publisher_channel(self, exchange: str) -> AbstractChannel:
        """The channel ``exchange``'s publishes go on; opened (with confirms, unroutable messages
        raising) when there is none or it was retired. A robust channel: restored with the
        connection."""
        async with self._publisher_lock:
            channel = self._publishers.get(exchange)
            if channel is not None and channel.is_closed:
                # closed by the server (a channel error): closed for good here too, or the robust
                # channel would reopen itself beside its replacement and stay open unused
                self._close_later(channel, 0.0)
                channel = None
            if channel is None:
                assert self.connection is not None
                channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
                self._publishers[exchange] = channel
                self.publishers_opened += 1
            return channel

    def _retire(self, exchange: str, channel: AbstractChannel | None) -> None:
        """A channel nacked a publish: the next publish to ``exchange`` opens another (at most one
        retirement per ``RETIRE_INTERVAL``, so a queue that refuses everything cannot make a
        channel per nack). It is closed once the publishes still awaiting its confirms had time to
        get them."""
        if channel is None or channel is not self._publishers.get(exchange):
            return  # already retired by another nack
        now = asyncio.get_running_loop().time()
        if now - self._retired_at.get(exchange, float("-inf")) < RETIRE_INTERVAL:
            return
        self._retired_at[exchange] = now
        del self._publishers[exchange]
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
        for task in (self._connector, *self._retired):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.connection is not None:
            await self.connection.close()
