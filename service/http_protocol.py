"""uvicorn's HTTP protocol with bounds on receiving a request: its headers, then its body.

uvicorn bounds idle keep-alive connections, but not a connection that sends its request line,
headers or body a byte at a time: each such connection is held for as long as the client likes,
and enough of them lock everyone out. Here a request's headers must be complete within
``header_timeout`` seconds of the connection opening (or of the request's first byte), and its body
within ``body_timeout`` seconds of its headers. A slower request gets 408 with the gateway's JSON
error and the connection is closed.

Every connection always has a clock: between requests it is uvicorn's keep-alive timer until a
byte arrives (uvicorn cancels that timer on any byte), then the header clock. Bytes that begin no
message start it too: llhttp skips CR and LF between messages without a callback, so a client
that answered ``\r\n`` to a response would otherwise hold its connection for ever. A pipelined
request waiting behind an earlier response is not timed while it waits: its bytes wait on us.
And a client that leaves the answers unread (pipelining requests without reading) has
``body_timeout`` seconds once the gateway's writes back up; then the connection is dropped.

The bounds live here, on the connection's own timer, rather than around every ``receive()`` in
middleware: one timer per request phase costs less on the serving path than an asyncio timeout per
body chunk. The app learns of a body timeout as a disconnect whose scope carries ``TIMED_OUT``
(the detail of the 408), so it can count the refusal like any other.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.middleware import REQUEST_ID_SCOPE, new_request_id

TIMED_OUT = "gateway.timed_out"
"""Scope key set (to the 408's detail) when the request's body did not arrive in time."""


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
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class TimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, header_timeout: float, body_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._timer_for: tuple[float, Callable[[], None]] | None = None
        """The deadline and expiry the armed timer was set for."""
        self._waiting: tuple[float, Callable[[], None]] | None = None
        """What the connection waits for now: (deadline on the loop's clock, what to do when it
        passes); None between requests."""
        self._body_bytes = 0
        self._handed_over = False
        """The connection belongs to a WebSocket protocol now: its clocks are that protocol's."""
        self._unread: asyncio.TimerHandle | None = None
        """Armed while writes are backed up (the client is not reading its answers)."""

    def _wait(self, seconds: float, expired: Callable[[], None]) -> None:
        self._waiting = (self.loop.time() + seconds, expired)

    def _sync_timer(self) -> None:
        """Arm the timer for what the connection still waits for once the bytes at hand are parsed.
        A request whose headers and body came in one read needs no timer at all: on the serving
        path that saves a timer armed and cancelled twice per request."""
        if self._waiting == self._timer_for:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_for = self._waiting
        if self._waiting is not None:
            deadline, expired = self._waiting
            self._timer = self.loop.call_at(deadline, self._expire, expired)

    def _expire(self, expired: Callable[[], None]) -> None:
        self._timer = self._timer_for = self._waiting = None
        expired()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait(self.header_timeout, self._headers_too_slow)
        self._sync_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting is None and (self.cycle is None or self.cycle.response_complete) and not self._handed_over:
            # Between requests, bytes that began no message (CR, LF): uvicorn has just cancelled its
            # keep-alive timer, so these bytes start the header clock.
            self._wait(self.header_timeout, self._headers_too_slow)
        self._sync_timer()

    def handle_websocket_upgrade(self) -> None:
        self._handed_over = True
        self._waiting = None
        self._sync_timer()
        super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._waiting is None:  # not the connection's first request, whose clock started at connect
            self._wait(self.header_timeout, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._waiting = None
        before = self.cycle
        super().on_headers_complete()
        if self.parser.should_upgrade():  # the connection is handed to another protocol
            self._sync_timer()
            return
        if self.cycle is not None and self.cycle is not before:  # its task has not run yet
            self.cycle.transport = CoalescingTransport(self.transport, self.loop)  # type: ignore[assignment]
        self._body_bytes = 0
        self._wait(self.body_timeout, self._body_too_slow)  # ended at once by a bodiless message

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._waiting = None
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread is None:
            self._unread = self.loop.call_later(self.body_timeout, self._answers_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _answers_unread(self) -> None:
        """The client left the answers unread for ``body_timeout``: drop the connection (``close``
        would wait for it to read what is pending, which it may never do)."""
        self._unread = None
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._waiting = None
        self._sync_timer()
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier response is still being made: a pipelined request's bytes may wait unread
            # behind it (reading is paused), and no answer may go before it. Time it afresh.
            self._wait(self.header_timeout, self._headers_too_slow)
            self._sync_timer()
            return
        self._refuse(f"the request headers did not arrive within {self.header_timeout:g} s")

    def _body_too_slow(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_started:  # answered early (e.g. 429): just stop reading
            self.transport.close()
            return
        if self.pipeline and self.flow.read_paused:  # waiting its turn behind an earlier response, unread
            self._wait(self.body_timeout, self._body_too_slow)
            self._sync_timer()
            return
        detail = f"the request body did not arrive within {self.body_timeout:g} s ({self._body_bytes} bytes received)"
        cycle.scope[TIMED_OUT] = detail  # type: ignore[literal-required]
        self._refuse(detail, cycle.scope.get(REQUEST_ID_SCOPE))  # type: ignore[arg-type]

    def _refuse(self, detail: str, request_id: str | None = None) -> None:
        """Answer 408 in the gateway's error shape (with the request's id, or a new one when the
        request never got as far as the app) and close."""
        if self.transport.is_closing():
            return
        request_id = request_id or new_request_id()
        body = json.dumps({"error": "request_timeout", "detail": detail, "request_id": request_id}).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.transport.close()


def http_protocol(header_timeout: float, body_timeout: float) -> Any:
    """The protocol class to hand uvicorn (``http=``); picklable, for several worker processes."""
    return partial(TimeoutProtocol, header_timeout=header_timeout, body_timeout=body_timeout)
