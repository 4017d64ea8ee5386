"""A TCP relay in front of the broker whose connections a test can cut, as a network drop does: the
client sees its connection reset while the broker stays up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress


class Relay:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.accepted = 0
        """Connections accepted so far."""
        self._transports: set[asyncio.Transport] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            broker_reader, broker_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        self._transports |= {client_writer.transport, broker_writer.transport}  # type: ignore[arg-type]
        for task in (
            asyncio.create_task(self._pipe(client_reader, broker_writer)),
            asyncio.create_task(self._pipe(broker_reader, client_writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def cut(self) -> None:
        """Reset every connection through the relay, both sides."""
        for transport in self._transports:
            transport.abort()
        self._transports.clear()


@asynccontextmanager
async def relay_to(host: str, port: int) -> AsyncIterator[tuple[Relay, int]]:
    """A relay to ``host:port`` on a free loopback port: the relay and its port."""
    relay = Relay(host, port)
    server = await asyncio.start_server(relay._serve, "127.0.0.1", 0)
    try:
        yield relay, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        relay.cut()
        for task in list(relay._tasks):
            task.cancel()
        await asyncio.gather(*relay._tasks, return_exceptions=True)
        await server.wait_closed()
