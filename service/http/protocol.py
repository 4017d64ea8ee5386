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
And a client that leaves the answers unread (pipelining requests without reading, or reading
none of one answer) has ``body_timeout`` seconds once the gateway's writes back up (any byte the
kernel's buffer cannot take); then the connection is dropped.

A request's head is bounded in bytes too: llhttp and httptools set no limit (httptools grows one
header by concatenation, in time quadratic in its length), so within ``header_timeout`` a client
could send hundreds of MiB of header on one connection, or of trailers after a chunked body. A
head over ``MAX_HEAD_BYTES`` or with more than ``MAX_HEADERS`` headers, or trailers over
``MAX_HEAD_BYTES``, get 431 and the connection is closed; a head or trailers still arriving are
counted per read, so they are cut off at most one read past the bound. Bytes that are not HTTP get
400 in the gateway's error shape (uvicorn's own answer is plain text), then close.

A chunked body is bounded in chunks and in framing too. Each chunk costs the event loop a few
parser callbacks (about a microsecond): a million one-byte chunks, 6 MB on the wire for a body of
1 MB (well under the body limit), held the loop 0.9 s per connection. A body may come in at most
``max_chunks(max_body_bytes)`` chunks, one per ``MIN_MEAN_CHUNK`` bytes of the body limit (a
client streaming 4 KiB or 64 KiB pieces, as HTTP clients do, is far within it); past it, 413. And
llhttp skips a chunk's extensions without bound: a chunk's size line (extensions included) is
counted like a head, and over ``MAX_HEAD_BYTES`` gets 400. A body refused here is answered by the
protocol (JSON, with the request's id) and the connection closed; the app learns of it as a
disconnect whose scope carries ``REFUSED`` (the error answered), so it can count the refusal.

A subclass may answer a request from its head alone (``service.http.refusing``): its body is then
parsed and dropped (``_skip_body``), within the same bounds.

The bounds live here, on the connection's own timer, rather than around every ``receive()`` in
middleware: one timer per request phase costs less on the serving path than an asyncio timeout per
body chunk. The app learns of a body timeout as a disconnect whose scope carries ``TIMED_OUT``
(the detail of the 408), so it can count the refusal like any other.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import BadRequest, GatewayError, HeadersTooLarge, PayloadTooLarge, RequestTimeout, error_body
from service.http.middleware import REFUSED, REQUEST_ID_SCOPE, new_request_id
from service.http.transport import CoalescingTransport

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes of a request's URL, header names and values (with their separators): 431 over
it. Four times uvicorn's h11 bound, room for big cookies and a proxy's headers."""
MAX_HEADERS = 256
"""The most header fields in a request: 431 over it."""
MIN_MEAN_CHUNK = 1024
"""A chunked body may come in one chunk per this many bytes of the body limit (``max_chunks``)."""
MIN_CHUNKS = 64
"""... and in this many chunks whatever the body limit."""


def max_chunks(max_body_bytes: int) -> int:
    """The most chunks a chunked request body may come in, its last (empty) one included: 413 past it."""
    return max(MIN_CHUNKS, max_body_bytes // MIN_MEAN_CHUNK)


_HEAD, _TRAILERS, _SIZE_LINE = "head", "trailers", "size line"
"""What is being counted: a request's head, a chunked body's trailers, or a chunk's size line."""

TIMED_OUT = "gateway.timed_out"
"""Scope key set (to the 408's detail) when the request's body did not arrive in time."""
ON_DISCONNECT = "gateway.on_disconnect"
"""Scope key an app may set to a callable: called (on the event loop, once) if the connection is
lost before the request's answer is complete. Cheaper than a task per request awaiting
``http.disconnect``; a server without this protocol never calls it."""


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; uvicorn's parser-error path answers with
    ``TimeoutProtocol._refusal``."""


class TimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above: on time, head bytes, chunks and framing."""

    def __init__(self, *args: Any, header_timeout: float, body_timeout: float, max_chunks: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_chunks = max_chunks
        self._chunks = 0
        """Chunks of the body being received."""
        self._in_body = False
        """The parser is in the body (or trailers) of ``self.cycle``'s request."""
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
        self._counting = False
        """A request's head, a chunked body's trailers or a chunk's size line has begun and is not
        complete yet."""
        self._counted = _HEAD
        """... which of them."""
        self._count_began = False
        """... and began in the read being parsed (part of that read may come before it)."""
        self._head_first = 0
        """The length of the read the counted part began in (an upper bound of its bytes there)."""
        self._head_rest = 0
        """The bytes of the reads after that one that ended with the counted part still open."""
        self._read_len = 0
        """The length of the read being parsed."""
        self._refusal: GatewayError | None = None
        """The answer to give in place of uvicorn's 400."""
        self._skip_body = False
        """The body being received is not the app's (its request was answered from its head):
        parsed, within the bounds, and dropped."""

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
        # Any write the kernel's buffer cannot take pauses writing (and starts the unread clock): at
        # the default 64 KiB high-water mark, a client that stopped reading with less than that
        # pending held its connection for ever, since the close that ends a connection (keep-alive,
        # a 408) waits for pending writes to leave.
        transport.set_write_buffer_limits(high=0)
        super().connection_made(transport)
        self._task_writes = CoalescingTransport(transport, self.loop)
        """What every request's task writes through (one per connection, so that the protocol's
        own writes can be ordered after all of theirs: ``_own_write``)."""
        self._wait(self.header_timeout, self._headers_too_slow)
        self._sync_timer()

    def data_received(self, data: bytes) -> None:
        self._read_len = len(data)
        super().data_received(data)
        if self._after_read():
            self._sync_timer()
            return
        if self._counting:  # a head or trailers still arriving: count them, with no wait for their end
            self._count()
        if self._waiting is None and (self.cycle is None or self.cycle.response_complete) and not self._handed_over:
            # Between requests, bytes that began no message (CR, LF): uvicorn has just cancelled its
            # keep-alive timer, so these bytes start the header clock.
            self._wait(self.header_timeout, self._headers_too_slow)
        self._sync_timer()

    def _count(self) -> None:
        if self._count_began:
            self._count_began = False
            self._head_first = self._read_len
            return
        self._head_rest += self._read_len
        if self._head_rest <= MAX_HEAD_BYTES:
            return
        self._counting = False
        if self._counted == _HEAD:
            self._waiting = None
            self._answer(HeadersTooLarge(f"the request's URL and headers are over {MAX_HEAD_BYTES} bytes"))
        elif self._counted == _TRAILERS:
            self._refuse_body(HeadersTooLarge(f"the request's trailers are over {MAX_HEAD_BYTES} bytes"))
        else:
            self._refuse_body(
                BadRequest(f"a chunk's size line (its extensions included) is over {MAX_HEAD_BYTES} bytes")
            )

    def _start_count(self, counted: str) -> None:
        self._counting = self._count_began = True
        self._counted = counted
        self._head_first = self._head_rest = 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes the parser refuses (and to a refusal raised in a callback):
        a request's body refused (its framing malformed, too many chunks) is the request's answer."""
        if self._in_body:
            self._refuse_body(self._refusal or BadRequest("the request's chunked body is not valid HTTP/1.1"))
            return
        refusal = self._refusal or BadRequest("the request is not valid HTTP/1.1")
        self._waiting = None
        self._answer(refusal)

    def _refuse_body(self, refusal: GatewayError) -> None:
        """Refuse the body of the request being received: answer (with its id) and close, and tell
        the app (``REFUSED``). If an answer has begun, or an earlier request's is being made
        (pipelining), no answer can go now: just close."""
        self._in_body = False
        self._waiting = None
        cycle = self.cycle
        if cycle.response_started or self.pipeline:
            self._own_close()
            return
        cycle.scope[REFUSED] = refusal  # type: ignore[literal-required]
        self._answer(refusal, cycle.scope.get(REQUEST_ID_SCOPE))  # type: ignore[arg-type]

    def handle_websocket_upgrade(self) -> None:
        self._handed_over = True
        self._waiting = None
        self._sync_timer()
        super().handle_websocket_upgrade()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._waiting is None:  # not the connection's first request, whose clock started at connect
            self._wait(self.header_timeout, self._headers_too_slow)
        self._start_count(_HEAD)

    def on_headers_complete(self) -> None:
        self._counting = False
        if len(self.headers) > MAX_HEADERS:
            self._refuse_head(f"the request has {len(self.headers)} headers; at most {MAX_HEADERS}")
        # The reads the head spans bound its size; only a head that may be over is measured.
        if self._head_first + self._head_rest + self._read_len > MAX_HEAD_BYTES and self._head_size() > MAX_HEAD_BYTES:
            self._refuse_head(f"the request's URL and headers are over {MAX_HEAD_BYTES} bytes")
        self._waiting = None
        if self._answers_head():
            self._skip_body = True
            self._body_bytes = self._chunks = 0
            self._in_body = True
            self._start_count(_SIZE_LINE)
            return
        before = self.cycle
        super().on_headers_complete()
        if self.parser.should_upgrade():  # the connection is handed to another protocol
            self._sync_timer()
            return
        if self.cycle is not None and self.cycle is not before:  # its task has not run yet
            self.cycle.transport = self._task_writes  # type: ignore[assignment]
        self._body_bytes = self._chunks = 0
        self._in_body = True
        self._wait(self.body_timeout, self._body_too_slow)  # ended at once by a bodiless message
        # Until a byte of body: a chunk's size line, if the body is chunked (ended at once otherwise)
        self._start_count(_SIZE_LINE)

    def _answers_head(self) -> bool:
        """Whether the request whose head was just parsed is answered from it (a subclass's
        choice): its body is then skipped, and ``_body_skipped`` called at its end."""
        return False

    def _body_skipped(self) -> None:
        """The body of a request answered from its head has been skipped to its end."""

    def _after_read(self) -> bool:
        """Called after each read is parsed: True when the subclass has taken the connection over
        for what is left of it (the usual end-of-read clocks are then not started)."""
        return False

    def _head_size(self) -> int:
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _refuse_head(self, detail: str) -> None:
        self._refusal = HeadersTooLarge(detail)
        raise _Refused(detail)

    def on_chunk_header(self) -> None:
        """A chunk's size line was parsed: until a byte of its data comes, what comes (if anything)
        is the trailers after the last chunk, which llhttp and httptools take in without bound."""
        self._chunks += 1
        if self._chunks > self.max_chunks:
            self._refusal = PayloadTooLarge(
                f"the request body is in over {self.max_chunks} chunks (one per {MIN_MEAN_CHUNK} bytes of the "
                "body limit); send it in larger chunks, or with Content-Length"
            )
            raise _Refused(self._refusal.detail)
        self._start_count(_TRAILERS)

    def on_chunk_complete(self) -> None:
        """A chunk's data (or the trailers) ended: what comes next is a chunk's size line."""
        self._start_count(_SIZE_LINE)

    def on_body(self, body: bytes) -> None:
        self._counting = False
        self._body_bytes += len(body)
        if not self._skip_body:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._waiting = None
        self._counting = self._in_body = False
        if self._skip_body:
            self._skip_body = False
            self._body_skipped()
            return
        super().on_message_complete()
        if not self.pipeline and self.cycle is not None and not self.cycle.response_complete:
            # uvicorn's pause over its 64 KiB high-water mark ends in the app's next receive(), none
            # once the body is complete: a photo's client that left went unseen (computed, counted
            # 200). A request pipelined behind this one pauses reading again (one queued at most).
            self.flow.resume_reading()

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
        self._in_body = False
        self._sync_timer()
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None
        cycle = self.cycle
        super().connection_lost(exc)
        # A refused body is not a client that left: the request's task learns of it reading the body
        if cycle is not None and not cycle.response_complete and REFUSED not in cycle.scope:
            hook = cast(dict[str, Any], cycle.scope).pop(ON_DISCONNECT, None)
            if hook is not None:
                hook()

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
            self._own_close()
            return
        if self.pipeline and self.flow.read_paused:  # waiting its turn behind an earlier response, unread
            self._wait(self.body_timeout, self._body_too_slow)
            self._sync_timer()
            return
        detail = f"the request body did not arrive within {self.body_timeout:g} s ({self._body_bytes} bytes received)"
        cycle.scope[TIMED_OUT] = detail  # type: ignore[literal-required]
        self._in_body = False
        self._refuse(detail, cycle.scope.get(REQUEST_ID_SCOPE))  # type: ignore[arg-type]

    def _refuse(self, detail: str, request_id: str | None = None) -> None:
        """Answer 408 (with the request's id, or a new one when the request never got as far as
        the app) and close."""
        self._answer(RequestTimeout(detail), request_id)

    def _answer(self, refusal: GatewayError, request_id: str | None = None) -> None:
        """Answer in the gateway's error shape and close."""
        if self.transport.is_closing():
            return
        request_id = request_id or new_request_id()
        body = json.dumps(error_body(refusal.error, refusal.detail, request_id)).encode()
        headers = [("content-type", "application/json"), ("x-request-id", request_id)]
        self._own_write(raw_answer(refusal.status_code, headers, body, keep_alive=False))
        self._own_close()

    def _own_write(self, data: bytes) -> None:
        """Write an answer of the protocol's own (a refusal) after the answers the requests' tasks
        wrote, which wait for the end of the loop's turn (``CoalescingTransport``): without it, a
        pipelined request's 408 went out first, and the earlier answer was dropped by the close
        (seen under load: the timer fired in the turn that answer was completed)."""
        self._task_writes.flush()
        self.transport.write(data)

    def _own_close(self) -> None:
        """Close once the answers written are sent (``close`` sends what the transport holds, not
        what waits for the end of the turn)."""
        self._task_writes.flush()
        self.transport.close()


def raw_answer(status: int, headers: list[tuple[str, str]], body: bytes, *, keep_alive: bool) -> bytes:
    """An HTTP/1.1 answer written by the protocol itself (outside any request's task): its status
    line, ``headers``, ``Connection: close`` unless ``keep_alive``, and ``body`` with its length."""
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"]
    head += [f"{name}: {value}\r\n" for name, value in headers]
    if not keep_alive:
        head.append("connection: close\r\n")
    head.append(f"content-length: {len(body)}\r\n\r\n")
    return "".join(head).encode("latin-1") + body
