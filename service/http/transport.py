"""A connection's writes of one event-loop turn, sent as one (``service.http.protocol`` wraps each
request's transport in it)."""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """A connection's writes of one event-loop turn, sent as one: uvicorn writes a response's status
    line and headers, then its body, each with its own ``send()``, and on uvloop each send is a
    system call made holding the GIL. Every other transport method is the connection's own;
    ``close`` sends what is pending first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        """Send what is pending now (the protocol does before writing an answer of its own)."""
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
