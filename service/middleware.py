"""Pure ASGI middleware: bounds on receiving request bodies, API keys, and per-route request metrics."""

from __future__ import annotations

import hmac
import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, QueueFull, Unauthorized, error_response
from service.metrics import Metrics


class BodyLimitMiddleware:
    """Bound what receiving request bodies may cost in bytes (their time is bounded by the HTTP
    protocol, ``service.http_protocol``).

    * A body over ``max_bytes`` is refused (413): at once from Content-Length, or as soon as a
      streamed (chunked) body passes the limit, so no more than the limit is ever buffered.
    * The bodies of all requests being handled together may hold at most ``max_buffered_bytes``;
      a chunk that would pass it gets 429. Memory is bounded by bytes actually received, so slow
      senders, who hold few, cannot lock out everyone else the way a count of uploads would.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_buffered_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.metrics = metrics
        self.buffered = 0
        """Body bytes received by the requests being handled now."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    error = PayloadTooLarge(f"request body is {declared} bytes; the limit is {self.max_bytes}")
                    self.metrics.rejections.labels(error.error).inc()
                    await error_response(error)(scope, receive, send)
                    return
                break
        received = 0
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            message = await receive()
            if complete or message["type"] != "http.request":
                return message
            size = len(message.get("body", b""))
            received += size
            self.buffered += size
            complete = not message.get("more_body", False)
            if received > self.max_bytes:
                raise PayloadTooLarge(f"request body is over the limit of {self.max_bytes} bytes")
            if self.buffered > self.max_buffered_bytes:
                raise QueueFull(f"request bodies being handled hold over {self.max_buffered_bytes} bytes; retry later")
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            self.buffered -= received


class MetricsMiddleware:
    """Count requests and time them by route template (not raw path, to bound label values)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self._series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        """Label children by (route, method, status): ``labels()`` costs a lock and a validation."""

    def _record(self, route: str, method: str, status: int, seconds: float) -> None:
        series = self._series.get((route, method, status))
        if series is None:
            series = (
                self.metrics.http_requests.labels(route, method, str(status)),
                self.metrics.http_duration.labels(route, f"{status // 100}xx"),
            )
            if len(self._series) < 1024:  # methods and statuses are few, but a client chooses them
                self._series[(route, method, status)] = series
        series[0].inc()
        series[1].observe(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self._record(route, scope["method"], status, time.perf_counter() - start)


OPEN_PATHS = frozenset({"/healthz", "/readyz"})
AUTHENTICATED = "gateway.authenticated"
"""Scope key telling routes whether the caller presented a valid key (or none is needed)."""


class ApiKeyMiddleware:
    """Optional API keys: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.

    Keys are compared in constant time against every configured key (no early exit), and a missing
    key and a wrong one get the same answer, so nothing tells a caller which part failed."""

    def __init__(self, app: ASGIApp, keys: list[bytes], open_paths: frozenset[str], metrics: Metrics) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.metrics = metrics

    def _valid(self, presented: bytes) -> bool:
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(presented, key)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys:
            scope[AUTHENTICATED] = True
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].strip()
            elif name == b"x-api-key":
                presented = value.strip()
        scope[AUTHENTICATED] = bool(presented) and self._valid(presented)
        if scope[AUTHENTICATED] or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        error = Unauthorized(
            "a valid API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
        self.metrics.rejections.labels(error.error).inc()
        await error_response(error)(scope, receive, send)
