"""A connection to RabbitMQ that the API can hold while the broker is down.

``connect_robust`` only reconnects after a first success, so the first connection is retried here
in the background; until it exists, and whenever it is lost, ``publish`` fails at once with 503
rather than hanging. Publishes use publisher confirms and ``mandatory``, with a timeout; the channel
is opened with aio-pika's ``on_return_raises``, so a publish the broker returns as unroutable fails
(``PublishError``) like a nacked one instead of counting as confirmed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import aio_pika
from aio_pika.abc import AbstractExchange, AbstractMessage, AbstractRobustChannel, AbstractRobustConnection
from pamqp.common import FieldTable

from service.errors import BackendUnavailable
from service.jobs import frames
from service.jobs.topology import Names, Topology, declare

logger = logging.getLogger(__name__)


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
    ) -> None:
        frames.install()  # a message with hostile properties must not close the connection
        self.url = url
        self.names = names
        self.publish_timeout = publish_timeout
        self.prefetch = prefetch
        self._on_connect = on_connect
        self.name = name
        """Connection name shown by RabbitMQ (management UI, ``rabbitmqctl list_connections``)."""
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractRobustChannel | None = None
        self.topology: Topology | None = None
        self._connector: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    async def _connect_once(self) -> None:
        properties: FieldTable | None = {"connection_name": self.name} if self.name else None
        connection = await aio_pika.connect_robust(
            self.url, timeout=5, reconnect_interval=1, client_properties=properties
        )
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.prefetch:
                await channel.set_qos(prefetch_count=self.prefetch)
            self.topology = await declare(connection, channel, self.names)
            self.connection, self.channel = connection, channel
            if self._on_connect is not None:  # its consumers are part of being connected
                await self._on_connect(self)
        except BaseException:  # a failed set-up must not leave a connection behind per retry
            self.connection = self.channel = None
            await connection.close()
            raise
        self.connected.set()
        logger.info("broker: connected to %s", redact(self.url))

    async def _connect_forever(self) -> None:
        delay = 0.5
        while True:
            try:
                await self._connect_once()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("broker: cannot connect to %s (%s); retrying in %.1f s", redact(self.url), exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

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
        if self.is_open:
            return "ok"
        return f"not connected to {redact(self.url)}"

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
        exchange: AbstractExchange = {
            "requests": self.topology.requests_exchange,
            "results": self.topology.results_exchange,
            "dead": self.topology.dead_exchange,
            "queue": self.channel.default_exchange,
        }[target]
        try:
            await exchange.publish(message, routing_key, mandatory=True, timeout=self.publish_timeout)
        except aio_pika.exceptions.PublishError as exc:  # returned: no queue is bound for it
            raise BackendUnavailable(f"the broker could not route the message to {routing_key!r}") from exc
        except aio_pika.exceptions.DeliveryError as exc:  # nacked: a queue refused it (full, ...)
            raise BackendUnavailable(f"the broker refused the message ({exc})") from exc
        except (TimeoutError, aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            raise BackendUnavailable(f"the broker did not confirm the message ({type(exc).__name__}: {exc})") from exc

    async def aclose(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
        if self.connection is not None:
            await self.connection.close()
