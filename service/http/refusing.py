"""The gateway's HTTP protocol: ``TimeoutProtocol``'s bounds, and requests refused from their head.

Past capacity most requests are refused, and a client that is refused sends its next request at
once, often with a photo of several hundred KB. Refused by the app, each cost the event loop what
any request costs (its task, the middleware, a response) and then its upload, read to reach the
next request; at 4x overload that took half of two cores, and the gateway delivered 0.6x its own
capacity. So at the end of each request's head the protocol asks the lifespan state's
``EARLY_GATE`` (``service.http.early``) whether the request is refused anyway, and answers it
itself: no ASGI task, no middleware, no decode, body budget or batcher work.

Then, for the request's body and the connection:

* **Kept alive, and not read until ``Retry-After``** (``EarlyAnswer.park``): when the client keeps
  its connection alive, the body is in hand or at most ``DRAIN_LIMIT`` bytes of it are still to
  come, and the client did not ask to be told before sending it (``Expect: 100-continue``). The
  answer goes at once; then the connection is not read for the ``Retry-After`` it gave, so a
  client that sends again at once waits, unread, at no cost to anyone; the rest of the refused
  body is then read and dropped unparsed as a body (one per ``Retry-After`` per connection).
* **Closed** otherwise (``Connection: close`` in the answer): the answer goes at once, writing is
  shut (RFC 9112, 9.6: the client reads the answer and, as HTTP/1.1 asks of a client sending a
  body, stops sending), what still arrives is dropped unparsed, and the connection closes when the
  client closes its side, the declared body has come, or ``LINGER_SECONDS`` pass.

Why keep-alive clients are kept rather than closed: a client told to close reconnects and sends
again at once, and a new connection's request has to be read to be refused. Measured with wrk at
256 connections against 64 served (250 KB photos, 2 cores, EfficientNet-Lite0): answering
``Connection: close`` delivered 0.66x the gateway's capacity, its 2,000 refusals/s taking 0.38 of a
core in the event loop and the clients' reconnects as much again; keeping the connection and not
reading it until ``Retry-After`` delivered 1.02x, with 150 refusals/s. Closing stays for what
cannot be kept cheaply: an upload over ``DRAIN_LIMIT`` still to come (its client should stop
sending, not be drained), a client that waits for ``100 Continue`` (its body may never come, or
come as the next request), a client that asked to close, and a body declared over the limit (413).

The price of keeping: a connection is not read for its ``Retry-After`` whatever comes on it, so a
client that pools its connections and sends another user's request on a refused one waits with it
(a client that honours ``Retry-After`` waits anyway). Waking a parked connection as soon as a slot
frees was tried: every client then took its turn in the slots, and the latency of the answers
served at 4x rose from 0.36 to 1.3 s (p50) for the same goodput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from service.errors import GatewayError
from service.http.protocol import TimeoutProtocol, max_chunks, raw_answer

EARLY_GATE = "gateway.early_gate"
"""Lifespan-state key of the ``Gate`` asked at the end of each request's head (not while an
earlier request on the connection is being answered)."""
DRAIN_LIMIT = 1024 * 1024
"""The most bytes of a refused body still to come for which the connection is kept (and the body
read later, unparsed); more, and it is closed."""
LINGER_SECONDS = 2.0
"""The most seconds a connection closed on a refused upload waits for its client to close its side."""


@dataclass(frozen=True)
class EarlyAnswer:
    """A request's answer decided from its head: its status, headers and body, and how long its
    connection is then not read (0: read on at once)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    park: float = 0.0

    def encode(self, keep_alive: bool) -> bytes:
        return raw_answer(self.status, self.headers, self.body, keep_alive=keep_alive)


Gate = Callable[[bytes, bytes, list[tuple[bytes, bytes]], dict[str, Any]], EarlyAnswer | None]
"""``(method, URL, headers, scope) -> EarlyAnswer | None``: None hands the request to the app (and
the gate may leave what it decided in the request's ``scope``)."""


class RefusingProtocol(TimeoutProtocol):
    """``TimeoutProtocol`` answering what ``EARLY_GATE`` refuses from a request's head (see the
    module's text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early: EarlyAnswer | None = None
        """The answer of the request being skipped, until it is sent."""
        self._lingering = False
        """Writing is shut after a refused upload: what arrives is dropped unparsed."""
        self._to_drop = -1
        """... bytes of the declared body still due (-1: not known)."""

    def _answers_head(self) -> bool:
        if self.cycle is not None and not self.cycle.response_complete:
            return False  # pipelined behind an answer being made: the app's, in order
        if self.parser.should_upgrade():
            return False  # handed to another protocol (or refused by uvicorn), not an online request
        gate: Gate | None = self.app_state.get(EARLY_GATE)
        if gate is None:
            return False
        self._early = gate(self.parser.get_method(), self.url, self.headers, cast(dict[str, Any], self.scope))
        return self._early is not None

    def on_message_begin(self) -> None:
        self._unset_keepalive_if_required()  # armed by an early answer in the same read
        super().on_message_begin()

    def _body_skipped(self) -> None:
        answer, self._early = self._early, None
        if answer is None:  # answered and parked before its body was all here: now it is
            self._keep_alive()
            return
        keep_alive = self._keeps_alive()  # the body is in hand: nothing to drain
        self._own_write(answer.encode(keep_alive))
        if not keep_alive:
            self.transport.close()
        else:
            self._park(answer.park)

    def _after_read(self) -> bool:
        answer = self._early
        if answer is None or self.transport.is_closing():  # (an answer pending: its body is skipped)
            return False
        # The refused request's body is not all here: keep the connection, or close it.
        self._early = None
        declared = self._declared()
        due = declared - self._body_bytes if declared >= 0 else -1
        if answer.park and 0 <= due <= DRAIN_LIMIT and self._keeps_alive() and not self.expect_100_continue:
            self._own_write(answer.encode(keep_alive=True))
            self._park(answer.park)
            return True
        self._skip_body = self._in_body = self._counting = False
        self._own_write(answer.encode(keep_alive=False))
        if not self.transport.can_write_eof():
            self.transport.close()
            return True
        self.transport.write_eof()
        self._lingering, self._to_drop = True, due
        self._wait(LINGER_SECONDS, self.transport.close)
        return True

    def _keeps_alive(self) -> bool:
        """Whether the client keeps the connection, as uvicorn reckons it (HTTP/1.0 never does)."""
        return self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()

    def _declared(self) -> int:
        for name, value in self.headers:
            if name == b"content-length":
                return int(value) if value.isdigit() else -1
        return -1

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # a refused upload's remains: dropped, unparsed
            if self._to_drop >= 0:
                self._to_drop -= len(data)
                if self._to_drop <= 0:  # all the declared body is here: nothing more is due
                    self.transport.close()
            return
        super().data_received(data)

    def _park(self, seconds: float) -> None:
        """Leave the connection unread for ``seconds`` (its client's ``Retry-After``)."""
        if seconds <= 0:
            self._keep_alive()
            return
        self.flow.pause_reading()
        self._wait(seconds, self._unpark)

    def _unpark(self) -> None:
        self.flow.resume_reading()
        if self._skip_body:  # the refused body's rest is due now: within the body clock
            self._wait(self.body_timeout, self.transport.close)
            self._sync_timer()
        else:
            self._keep_alive()

    def _keep_alive(self) -> None:
        """Between requests: uvicorn's keep-alive clock, as after any answer."""
        if self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _refuse_body(self, refusal: GatewayError) -> None:
        if not self._skip_body:
            super()._refuse_body(refusal)
            return
        # The skipped body's framing is refused: the early answer if it is not sent yet, then close.
        self._skip_body = self._in_body = False
        self._waiting = None
        answer, self._early = self._early, None
        if answer is not None:
            self._own_write(answer.encode(keep_alive=False))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._early = None
        self._skip_body = self._lingering = False
        super().connection_lost(exc)


def http_protocol(header_timeout: float, body_timeout: float, max_body_bytes: int) -> Any:
    """The protocol class to hand uvicorn (``http=``); picklable, for several worker processes."""
    return partial(
        RefusingProtocol,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        max_chunks=max_chunks(max_body_bytes),
    )
