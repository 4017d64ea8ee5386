"""What every gRPC call goes through, as every HTTP request goes through the edge middleware
(``service.http.middleware``): its request id (``x-request-id`` metadata, else a new one) on the
log lines it causes, its trace (``traceparent`` metadata), its API key (``authorization: Bearer``
or ``x-api-key`` metadata) and that key's concurrency slot, its deadline (the call's gRPC deadline,
within ``request_timeout``), and its metrics (``gateway_grpc_requests_total`` by method and code).
A ``GatewayError`` ends the call with the status code its HTTP status maps to
(``service.grpc.status``); a call its client cancels is counted as a disconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import StatusCode

from service.errors import DeadlineExceeded, GatewayError, QuotaExceeded, Unauthorized
from service.grpc.status import code_of, trailers_of
from service.http.gateway import Gateway
from service.http.middleware import client_request_id, match_key, new_request_id, presented_key
from service.logs import REQUEST_ID
from service.settings.keys import ApiKey
from service.tracing import Tracing

OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
"""Answered without an API key, as /v2/health/live and /v2/health/ready are."""


@dataclass(frozen=True)
class Caller:
    """Who called, and by when the answer is wanted (event-loop time; None: no gRPC deadline)."""

    key_id: str | None
    deadline: float | None
    request_id: str
    admin_key: str | None = None
    """The ``x-admin-key`` metadata, for the repository's load and unload."""


def _metadata(context: Any) -> list[tuple[bytes, bytes]]:
    pairs = []
    for key, value in context.invocation_metadata() or ():
        pairs.append((key.encode("latin-1"), value if isinstance(value, bytes) else value.encode()))
    return pairs


class Calls:
    """The per-call work of the gRPC front, over the HTTP front's ``Gateway``."""

    def __init__(self, gateway: Gateway, keys: Sequence[ApiKey], tracing: Tracing | None) -> None:
        self.gateway = gateway
        self.keys = list(keys)
        self.tracing = tracing

    @asynccontextmanager
    async def call(self, method: str, context: Any) -> AsyncIterator[Caller]:
        """The body of one call (a streamed inference: of the stream, each request recorded by
        ``record``). A ``GatewayError`` the body raises aborts the call with its code."""
        metadata = _metadata(context)
        request_id = None
        carrier: dict[str, str] = {}
        for name, value in metadata:
            if name == b"x-request-id":
                request_id = client_request_id(value) or request_id
            elif name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        request_id = request_id or new_request_id()
        token = REQUEST_ID.set(request_id)
        span, trace_token = None, None
        if self.tracing is not None:
            span, trace_context = self.tracing.server_context(
                "POST", f"/inference.GRPCInferenceService/{method}", "grpc", carrier
            )
            trace_token = otel_context.attach(trace_context)
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        key_id: str | None = None
        entered = False
        try:
            try:
                key_id = self._authenticate(method, metadata)
                quotas = self.gateway.quotas
                if quotas is not None and key_id is not None and method not in OPEN_METHODS:
                    try:
                        quotas.enter(key_id)
                    except QuotaExceeded:
                        self.gateway.metrics.quota_rejections.labels(key_id, "concurrency").inc()
                        raise
                    entered = True
                admin = next((value.decode("latin-1") for name, value in metadata if name == b"x-admin-key"), None)
                yield Caller(key_id, _deadline(context), request_id, admin)
            except GatewayError as exc:
                code = code_of(exc)
                self.gateway.metrics.rejections.labels(exc.error).inc()
                context.set_trailing_metadata((*trailers_of(exc), ("x-request-id", request_id)))
                await context.abort(code, exc.detail)
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                self.gateway.metrics.client_disconnects.inc()
                raise
        finally:
            if entered and key_id is not None and self.gateway.quotas is not None:
                self.gateway.quotas.leave(key_id)
            self.record(method, code, time.perf_counter() - start)
            if span is not None:
                span.update_name(f"grpc {method}")
                span.set_attribute("rpc.system", "grpc")
                span.set_attribute("rpc.method", method)
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
                    span.set_status(StatusCode.ERROR)
                span.end()
            if trace_token is not None:
                otel_context.detach(trace_token)
            REQUEST_ID.reset(token)

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        name = code.name
        self.gateway.metrics.grpc_requests.labels(method, name).inc()
        self.gateway.metrics.grpc_duration.labels(method, name).observe(seconds)

    def _authenticate(self, method: str, metadata: list[tuple[bytes, bytes]]) -> str | None:
        """The id of the call's API key (None where keys are off, or for an open method without one)."""
        if not self.keys:
            return None
        key = match_key(self.keys, presented_key(metadata))
        if key is not None:
            return key.id
        if method in OPEN_METHODS:
            return None
        raise Unauthorized(
            "a valid API key is required: send metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"
        )


def _deadline(context: Any) -> float | None:
    """The call's gRPC deadline in event-loop time; one already past is a 504 (DEADLINE_EXCEEDED) now."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it started")
    return asyncio.get_running_loop().time() + remaining
