"""Pure ASGI middleware: a cap on request bodies, and per-route request metrics."""

from __future__ import annotations

import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import PayloadTooLarge, Unauthorized, error_response
from service.metrics import Metrics


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes``: at once from Content-Length, or as soon as a streamed
    (chunked) body passes the limit, so no more than the limit is ever buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
                    await error_response(error)(scope, receive, send)
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise PayloadTooLarge(f"request body is over the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)


class MetricsMiddleware:
    """Count requests and time them by route template (not raw path, to bound label values)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

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
            self.metrics.http_requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.http_duration.labels(route, f"{status // 100}xx").observe(time.perf_counter() - start)


OPEN_PATHS = frozenset({"/healthz", "/readyz"})
AUTHENTICATED = "gateway.authenticated"
"""Scope key telling routes whether the caller presented a valid key (or none is needed)."""


class ApiKeyMiddleware:
    """Optional API keys: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.

    Keys are compared in constant time against every configured key (no early exit), and a missing
    key and a wrong one get the same answer, so nothing tells a caller which part failed."""

    def __init__(self, app: ASGIApp, keys: list[bytes], open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

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
        await error_response(error)(scope, receive, send)
