"""What every gRPC call goes through, as every HTTP request goes through the edge middleware
(``service.http.middleware``): its request id (``x-request-id`` metadata, else a new one) on the
log lines it causes, its trace (``traceparent`` metadata), its API key (``authorization: Bearer``
or ``x-api-key`` metadata) and that key's concurrency slot, its deadline (the call's gRPC deadline,
within ``request_timeout``), and its metrics (``gateway_grpc_requests_total`` by method and code).
A ``GatewayError`` ends the call with the status code its HTTP status maps to
(``service.grpc.status``); a call its client cancels is counted as a disconnect."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
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

logger = logging.getLogger(__name__)

OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
SERVER_FAILURES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
)
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
        self._series: dict[tuple[str, grpc.StatusCode], tuple[Any, Any]] = {}
        """Metric children by (method, code): ``labels()`` costs a lock and a validation a call."""

    @asynccontextmanager
    async def call(self, method: str, context: Any, *, holds_slot: bool = True) -> AsyncIterator[Caller]:
        """The body of one call (a streamed inference: of the stream, whose requests each take
        the key's slot through ``slot``, so ``holds_slot`` is False). A ``GatewayError`` the body
        raises aborts the call with its code; anything else unexpected is INTERNAL, logged, with
        nothing of it told to the client. The code the call ended with is what its metrics say."""
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
        closed_elsewhere = False
        try:
            key_id = self._authenticate(method, metadata)
            admin = next((value.decode("latin-1") for name, value in metadata if name == b"x-admin-key"), None)
            caller = Caller(key_id, _deadline(context), request_id, admin)
            if holds_slot and method not in OPEN_METHODS:
                with self.slot(caller):
                    yield caller
            else:
                yield caller
        except GatewayError as exc:
            code = code_of(exc)
            self.gateway.metrics.rejections.labels(exc.error).inc()
            code = await _abort(context, code, exc.detail, (*trailers_of(exc), ("x-request-id", request_id)))
        except grpc.aio.AbortError:  # the body ended the call with a code of its own
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except asyncio.CancelledError:
            code = _ended(context)
            self.gateway.metrics.client_disconnects.inc()
            raise
        except GeneratorExit:  # a stream closed by the server for its client (cancelled, or past its deadline)
            code, closed_elsewhere = _ended(context), True
            self.gateway.metrics.client_disconnects.inc()
            raise
        except Exception:
            logger.exception("grpc: %s failed", method)
            message = "the gateway failed to answer (its log says why, under this request id)"
            code = await _abort(context, grpc.StatusCode.INTERNAL, message, (("x-request-id", request_id),))
        finally:
            self.record(method, code, time.perf_counter() - start)
            if span is not None:
                _end_span(span, method, code)
            if not closed_elsewhere:  # a generator closed elsewhere runs this in another context
                if trace_token is not None:
                    otel_context.detach(trace_token)
                REQUEST_ID.reset(token)

    @contextmanager
    def slot(self, caller: Caller) -> Iterator[None]:
        """One of the caller's API key's concurrency slots, for one call or one streamed request
        (429, RESOURCE_EXHAUSTED, when the key has none free)."""
        quotas = self.gateway.quotas
        if quotas is None or caller.key_id is None:
            yield
            return
        try:
            quotas.enter(caller.key_id)
        except QuotaExceeded:
            self.gateway.metrics.quota_rejections.labels(caller.key_id, "concurrency").inc()
            raise
        try:
            yield
        finally:
            quotas.leave(caller.key_id)

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        series = self._series.get((method, code))
        if series is None:  # methods and codes are a fixed, small set: one lookup each, ever
            metrics = self.gateway.metrics
            series = (metrics.grpc_requests.labels(method, code.name), metrics.grpc_duration.labels(method, code.name))
            self._series[(method, code)] = series
        series[0].inc()
        series[1].observe(seconds)

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


async def _abort(
    context: Any, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    """End the call with ``code`` (raises grpc's ``AbortError``). A call already over (its client
    cancelled, or its deadline passed, while it was worked on) cannot be: then it ends as
    cancelled, and the code it ended with is returned for its metrics."""
    try:
        context.set_trailing_metadata(trailers)
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception:  # grpcio's usage error: the call is done
        raise asyncio.CancelledError from None
    return code  # not reached: abort raises


def _ended(context: Any) -> grpc.StatusCode:
    """How a call the server ended for its client ended: past its deadline, or cancelled."""
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED


def _end_span(span: Any, method: str, code: grpc.StatusCode) -> None:
    span.update_name(f"grpc {method}")
    span.set_attribute("rpc.system", "grpc")
    span.set_attribute("rpc.method", method)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in SERVER_FAILURES:
        span.set_status(StatusCode.ERROR)
    span.end()


def _deadline(context: Any) -> float | None:
    """The call's gRPC deadline in event-loop time; one already past is a 504 (DEADLINE_EXCEEDED) now."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceeded("the call's deadline passed before it started")
    return asyncio.get_running_loop().time() + remaining


class KeyCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses a call without a valid API key before its message is read, as the HTTP front answers
    401 before reading a body: the refusal is a streaming handler, which grpcio runs without
    reading the request first (a unary handler would receive the whole message, up to
    ``max_body_bytes``, before it could refuse it)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method.rpartition("/")[2]
        if not self.calls.keys or method in OPEN_METHODS:
            return await continuation(details)
        pairs = [
            (key.encode("latin-1"), value if isinstance(value, bytes) else value.encode())
            for key, value in details.invocation_metadata or ()
        ]
        if match_key(self.calls.keys, presented_key(pairs)) is not None:
            return await continuation(details)
        calls = self.calls

        async def refuse(_requests: Any, context: Any) -> None:
            async with calls.call(method, context, holds_slot=False):
                pass  # not reached: the call refuses the key

        return grpc.stream_stream_rpc_method_handler(refuse)
