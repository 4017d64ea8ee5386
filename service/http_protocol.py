"""uvicorn's HTTP protocol with a bound on receiving request headers.

uvicorn bounds idle keep-alive connections, but not a connection that opens and then sends its
request line and headers a byte at a time: each such connection is held for as long as the client
likes, and ``max_connections`` of them lock everyone out with 503s. Here a request's headers must
be complete within ``header_timeout`` seconds of the connection opening or of the request's first
byte; a slower one gets 408 and the connection is closed. (Bodies have their own bound,
``body_timeout``, in ``service.middleware``.)
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderTimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_header_timer()

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        body = json.dumps(
            {
                "error": "request_timeout",
                "detail": f"the request headers did not arrive within {self.header_timeout:g} s",
            }
        ).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        self.transport.close()


def http_protocol(header_timeout: float) -> Any:
    """The protocol class to hand uvicorn (``http=``); picklable, for several worker processes."""
    return partial(HeaderTimeoutProtocol, header_timeout=header_timeout)
