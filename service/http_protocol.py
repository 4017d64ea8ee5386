"""uvicorn's HTTP protocol with bounds on receiving a request: its headers, then its body.

uvicorn bounds idle keep-alive connections, but not a connection that sends its request line,
headers or body a byte at a time: each such connection is held for as long as the client likes,
and enough of them lock everyone out. Here a request's headers must be complete within
``header_timeout`` seconds of the connection opening (or of the request's first byte), and its body
within ``body_timeout`` seconds of its headers. A slower request gets 408 with the gateway's JSON
error and the connection is closed.

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


class TimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, header_timeout: float, body_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._body_bytes = 0

    def _arm(self, seconds: float, expired: Callable[[], None]) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(seconds, expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, self._headers_too_slow)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.parser.should_upgrade():  # the connection is handed to another protocol
            return
        self._body_bytes = 0
        self._arm(self.body_timeout, self._body_too_slow)  # disarmed at once by a bodiless message

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._timer = None
        self._refuse(f"the request headers did not arrive within {self.header_timeout:g} s")

    def _body_too_slow(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_started:  # answered early (e.g. 429): just stop reading
            self.transport.close()
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
