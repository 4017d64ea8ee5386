"""The nodes of a RabbitMQ cluster behind one robust connection: aio-pika's ``RobustConnection``,
whose own reconnect loop takes each attempt to the next address.

aio-pika reconnects by itself: when the connection is lost or an attempt fails, its connection
factory waits ``reconnect_interval`` and connects again to ``url``. ``NodesConnection`` is the one
place that moves ``url`` on (in the close callback both events go through) and sets that interval:

- no wait between the addresses of a round: a dead address costs only its failed attempt;
- backoff (``Backoff``) once every address has failed in a row, so that the clients of a dead
  cluster do not hammer it, nor all arrive at the same instant when it returns;
- a short TCP connect timeout (``CONNECT_TIMEOUT``, doubling each round that fails, up to
  ``HANDSHAKE_TIMEOUT``): a refused address fails at once, a blackholed one (a host gone from the
  network) in a quarter of a second, instead of the whole attempt's timeout. The AMQP handshake
  after the TCP connect keeps ``HANDSHAKE_TIMEOUT`` (a node that accepts TCP and never answers,
  such as a frozen VM, costs that much per round).

The first attempt after a loss goes to the next address (every node of a cluster serves the same
queues), and the first connection too is made by that loop (``fail_fast`` off), so no other loop
rotates. With one address, a lost connection is retried at once, then with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aio_pika.robust_connection import RobustConnection
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from aiormq.exceptions import AMQPConnectionError
from yarl import URL

from service.settings.values import redact

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 0.25
"""Seconds for a TCP connect to a node in the first round after a loss; doubled each round that
fails (a slow link still gets through), up to ``HANDSHAKE_TIMEOUT``."""
HANDSHAKE_TIMEOUT = 5.0
"""Seconds for a whole attempt: TCP connect, then the AMQP handshake."""
DOUBLINGS = 32
"""Doublings counted at most, by the backoff and the connect timeout: far past their caps, and
``2**n`` within a float (past 1,023 failed rounds, about 3 hours of outage, it overflowed: every
attempt then raised before connecting, retried at once, for ever)."""


def addresses(url: str) -> list[str]:
    """The broker addresses of a ``GATEWAY_BROKER_URL``: one URL, or several comma-separated."""
    return [part.strip() for part in url.split(",") if part.strip()]


@dataclass
class Backoff:
    """Seconds before the next round of attempts: doubling from ``first`` up to ``cap``, each drawn
    from [0.5, 1.5) of that ("equal jitter"), so that many clients spread out instead of retrying in
    step."""

    first: float = 0.5
    cap: float = 10.0
    attempt: int = 0

    def next(self) -> float:
        base = min(self.cap, self.first * 2 ** min(self.attempt, DOUBLINGS))
        self.attempt += 1
        return float(base * random.uniform(0.5, 1.5))

    def reset(self) -> None:
        self.attempt = 0


class TimedTransport(TransportFactory):
    """aiormq's own TCP or TLS transport (by the address's scheme), given up after the connection's
    current connect timeout."""

    def __init__(self, connection: NodesConnection) -> None:
        self.connection = connection

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        inner = TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        timeout = self.connection.connect_timeout
        try:
            async with asyncio.timeout(timeout):
                return await inner.create(url, **kwargs)
        except TimeoutError as exc:
            raise AMQPConnectionError(f"no TCP connection to {url.host}:{url.port} in {timeout:g} s") from exc


class NodesConnection(RobustConnection):
    """A robust connection over several addresses: each of aio-pika's attempts goes to the next."""

    def __init__(self, nodes: Sequence[str], *, start: int = 0, **kwargs: Any) -> None:
        if not nodes:
            raise ValueError("no broker address")
        self.nodes = list(nodes)
        self.current = start % len(self.nodes)
        """Index of the address in use, or tried next."""
        self.failures = 0
        """Attempts failed in a row since the last connection."""
        self.backoff = Backoff()
        self.established = False
        """Connected, with channels restored (a loss, not a failed attempt, when it closes)."""
        self._tried: str | None = None
        super().__init__(URL(self.nodes[self.current]), fail_fast=False, **kwargs)
        self.reconnect_interval = 0
        self.kwargs["transport_factory"] = TimedTransport(self)

    @property
    def address(self) -> str:
        """The address in use, or tried next (as given, password included)."""
        return self.nodes[self.current]

    @property
    def connect_timeout(self) -> float:
        rounds = min(self.failures // len(self.nodes), DOUBLINGS)
        return float(min(HANDSHAKE_TIMEOUT, CONNECT_TIMEOUT * 2**rounds))

    def __str__(self) -> str:
        """The address in use or last tried (aio-pika's own log lines name it), without password."""
        return redact(self._tried or self.address)

    async def _on_connected(self) -> None:
        await super()._on_connected()  # restores the channels; raises (a failed attempt) if it cannot
        reconnected = self.connection_attempt > 1
        self.established, self.failures, self._tried = True, 0, None
        self.backoff.reset()
        self.reconnect_interval = 0  # aio-pika sleeps it after a success too: a loss must not wait
        if reconnected:  # its address only at debug, as ``Broker`` says "connected" (the warnings name them)
            logger.info("broker: reconnected")
            logger.debug("broker: reconnected to %s", redact(self.address))

    async def ready(self) -> None:
        """Wait until connected; but in aio-pika's own reconnect loop, fail at once when not.

        A consumer the broker cancels (its queue deleted, or its leader moved) makes that loop
        restore the consumers on the open connection; when the connection is lost meanwhile (a
        publish to a stream being deleted closes it: 506 or 541), the restore waited here for the
        loop itself to reconnect, for ever (aio-pika 10.2). Raised instead, it is a failed attempt
        the loop retries, by reconnecting."""
        if not self.connected.is_set() and asyncio.current_task() is self._reconnect_loop():
            raise AMQPConnectionError("the connection was lost while its consumers were being restored")
        await super().ready()

    def _reconnect_loop(self) -> asyncio.Task[None] | None:
        """aio-pika's reconnect task (a private attribute: ``aio-pika<11`` is pinned)."""
        task: asyncio.Task[None] | None = getattr(self, "_RobustConnection__reconnection_task", None)
        return task

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        """A loss or a failed attempt (aio-pika calls this for both, before its next attempt)."""
        if not (self.close_called or self.is_closed):
            self._move_on(closing)
        await super()._on_connection_close(closing)

    def _move_on(self, closing: asyncio.Future[Any]) -> None:
        lost, self.established = self.established, False
        self._tried = self.address
        self.failures = 0 if lost else self.failures + 1
        self.current = (self.current + 1) % len(self.nodes)
        self.url = URL(self.address)
        round_failed = self.failures > 0 and self.failures % len(self.nodes) == 0
        self.reconnect_interval = self.backoff.next() if round_failed else 0
        if lost:
            reason = closing.exception() if closing.done() and not closing.cancelled() else None
            logger.warning("broker: lost %s (%s); trying %s", redact(self._tried), reason, redact(self.address))
        else:
            logger.debug(
                "broker: attempt %d failed; trying %s in %.2f s",
                self.failures,
                redact(self.address),
                self.reconnect_interval,
            )
