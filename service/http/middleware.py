"""Pure ASGI middleware: request ids and per-route metrics, bounds on receiving request bodies, API keys."""

from __future__ import annotations

import hmac
import random
import re
import time
from collections.abc import Iterable

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, StatusCode
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import GatewayError, PayloadTooLarge, QueueFull, QuotaExceeded, Unauthorized, error_response_for
from service.http.quotas import Quotas
from service.logs import REQUEST_ID
from service.metrics import Metrics
from service.serving.fair import Admission
from service.settings.keys import ApiKey
from service.tracing import Tracing, trace_id_hex


class BodyBudget:
    """The body bytes of the requests being handled, by model: one pool first come, first served
    until the models are open (``serve``), then shared by weight (``service.serving.fair``), the
    model of a request read from its path (``/v1/models/{name}/...``, ``/v2/models/{name}/...``;
    any other path is the default model's)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.shares = Admission(limit, {"": 1.0}, fair=False)
        self.default = ""

    def serve(self, shares: Admission, default: str) -> None:
        """Share by ``shares`` (before any request is handled: nothing is held yet)."""
        self.shares, self.default = shares, default

    def model_of(self, path: str) -> str:
        parts = path.split("/", 4)
        if len(parts) > 3 and parts[2] == "models" and parts[1] in ("v1", "v2") and parts[3] in self.shares.active:
            return parts[3]
        return self.default

    def refusal(self, shares: Admission, model: str, size: int) -> QueueFull:
        """Why ``size`` more bytes for ``model`` were refused by ``shares`` (the pool its request
        started with)."""
        if shares.total + size > shares.limit or not shares.fair:
            return QueueFull(f"request bodies being handled hold over {shares.limit} bytes; retry later")
        return QueueFull(
            f"request bodies for model {model!r} hold {shares.active[model]} bytes, its share of the "
            f"{shares.limit} bytes and all it may borrow from the other models now; retry later"
        )


def declared_over(headers: Iterable[tuple[bytes, bytes]], max_bytes: int) -> PayloadTooLarge | None:
    """413 for a body whose ``Content-Length`` is over ``max_bytes`` (the HTTP parser has refused
    any Content-Length that is not digits), else None: said before a byte of it is read."""
    for name, value in headers:
        if name == b"content-length":
            declared = int(value) if value.isdigit() else 0
            if declared > max_bytes:
                return PayloadTooLarge(f"request body is {declared} bytes; the limit is {max_bytes}")
            return None
    return None


class BodyLimitMiddleware:
    """Bound what receiving request bodies may cost in bytes (their time is bounded by the HTTP
    protocol, ``service.http.protocol``).

    * A body over ``max_bytes`` is refused (413): at once from Content-Length, or as soon as a
      streamed (chunked) body passes the limit, so no more than the limit is ever buffered.
    * A body the HTTP protocol refused (too many chunks, malformed framing: it has answered and
      closed) is raised as its error where the app reads the disconnect, so it is counted.
    * The bodies of all requests being handled together may hold at most ``budget.limit`` bytes,
      shared by model (``BodyBudget``); a chunk that would pass the total, or its model's part and
      all it may borrow, gets 429. Memory is bounded by bytes actually received, so slow senders,
      who hold few, cannot lock out everyone else the way a count of uploads would, and a model
      flooded with uploads cannot take the bytes another model's uploads need.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, budget: BodyBudget, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (error := declared_over(scope["headers"], self.max_bytes)) is not None:
            self.metrics.rejections.labels(error.error).inc()
            await error_response_for(scope["path"])(error)(scope, receive, send)
            return
        budget = self.budget
        shares = budget.shares
        model = budget.model_of(scope["path"])
        received = 0
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            message = await receive()
            if complete or message["type"] != "http.request":
                if (refused := scope.get(REFUSED)) is not None:
                    raise refused  # the protocol answered it and closed: counted like any refusal
                return message
            size = len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if received + size > self.max_bytes:
                raise PayloadTooLarge(f"request body is over the limit of {self.max_bytes} bytes")
            if size and not shares.room(model, size):  # (an empty last chunk takes nothing)
                raise budget.refusal(shares, model, size)
            shares.enter(model, size)
            received += size
            return message

        try:
            await self.app(scope, limited_receive, send)
        finally:
            shares.leave(model, received)


RESERVED = "gateway.reserved"
"""Scope key: the ``Reservation`` of a request admitted from its head (``service.http.early``),
claimed where it starts (``ServedModels.hold``); ``RequestMiddleware``, the outermost layer, gives
it back if the request ends without (refused by a layer or a check, or its client gone)."""
REFUSED = "gateway.refused"
"""Scope key set (to the error answered) when the HTTP protocol refused the request's body and
closed the connection (``service.http.protocol``)."""
REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_SCOPE = "gateway.request_id"
"""Scope key holding the request's id (for layers that answer outside the request's task)."""
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
"""A request id a client may choose (it is echoed in headers, bodies and logs)."""
_TRACE_HEADERS = (b"traceparent", b"tracestate")


CLIENT_LEFT = "gateway.client_left"
"""Scope key set when the client disconnected before the answer (nothing was sent)."""
CLIENT_CLOSED_REQUEST = 499
"""The status recorded for such a request (nginx's "client closed request"); none is sent."""


def client_request_id(value: bytes) -> str | None:
    """The client's ``X-Request-ID`` (HTTP header or gRPC metadata) when it is a sane token."""
    return value.decode() if _CLIENT_ID.fullmatch(value) else None


def new_request_id() -> str:
    """16 random hex digits. Not ``os.urandom``: its system call releases the GIL, and under load
    taking it back cost the event loop a tenth of its time (py-spy). ``random`` is reseeded in
    every forked child, so worker processes do not repeat each other's ids."""
    return f"{random.getrandbits(64):016x}"


class RequestSeries:
    """The count and duration of HTTP requests by route template, method and status
    (``gateway_http_requests_total``, ``gateway_http_request_duration_seconds``), for the layers
    that answer requests: ``RequestMiddleware``, and the HTTP protocol's refusals from the headers.
    A request whose client left (499) is counted but not timed: it was never answered, and its
    time (until the client gave up) would read as slow 4xx answers."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._series: dict[tuple[str, str, int], tuple[Counter, Histogram | None]] = {}
        """Label children by (route, method, status): ``labels()`` costs a lock and a validation."""

    def record(self, route: str, method: str, status: int, seconds: float, span: Span | None = None) -> None:
        series = self._series.get((route, method, status))
        if series is None:
            series = (
                self.metrics.http_requests.labels(route, method, str(status)),
                None if status == CLIENT_CLOSED_REQUEST else self.metrics.http_duration.labels(route, str(status)),
            )
            if len(self._series) < 1024:  # methods and statuses are few, but a client chooses them
                self._series[(route, method, status)] = series
        series[0].inc()
        if series[1] is None:
            return
        if span is not None:
            series[1].observe(seconds, {"trace_id": trace_id_hex(span.get_span_context())})
        else:
            series[1].observe(seconds)


class RequestMiddleware:
    """The outermost layer of every HTTP request: its id, its trace, and its metrics.

    * The id is the client's ``X-Request-ID`` when it is a sane token, else a new one; it is
      answered in the ``X-Request-ID`` header, set in every error body (``errors.error_response``
      reads it) and on every log line the request causes (``service.logs.REQUEST_ID``).
    * With tracing on, a sampled request gets the server span (``METHOD /route``, the HTTP semantic
      conventions' attributes, error status on 5xx), current while it is handled; the decision
      costs next to nothing for the others (``Tracing.server_context``).
    * Requests are counted and timed by route template (not raw path, to bound label values); a
      sampled request's latency carries its trace id as an exemplar."""

    def __init__(self, app: ASGIApp, metrics: Metrics, tracing: Tracing | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.tracing = tracing
        self._record = RequestSeries(metrics).record
        self._in_flight = metrics.http_in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        request_id = None
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                request_id = client_request_id(value) or request_id
            elif name in _TRACE_HEADERS:
                carrier[name.decode()] = value.decode("latin-1")
        if request_id is None:
            request_id = new_request_id()
        scope[REQUEST_ID_SCOPE] = request_id
        token = REQUEST_ID.set(request_id)
        id_header = (REQUEST_ID_HEADER, request_id.encode())
        span = None
        trace_token = None
        if self.tracing is not None:
            span, context = self.tracing.server_context(
                scope["method"], scope["path"], scope.get("scheme", "http"), carrier
            )
            trace_token = otel_context.attach(context)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        in_flight = self._in_flight
        in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            in_flight.dec()
            if (reserved := scope.pop(RESERVED, None)) is not None:
                reserved.release()  # never claimed: the slot goes back (claimed: a no-op)
            if scope.get(CLIENT_LEFT):
                status = CLIENT_CLOSED_REQUEST  # not a failure of ours: no 5xx in the metrics
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self._record(route, scope["method"], status, time.perf_counter() - start, span)
            if span is not None:
                _end_server_span(span, scope["method"], route, status)
            if trace_token is not None:
                otel_context.detach(trace_token)
            REQUEST_ID.reset(token)


def _end_server_span(span: Span, method: str, route: str, status: int) -> None:
    span.update_name(f"{method} {route}")
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR)
    span.end()


OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
AUTHENTICATED = "gateway.authenticated"
"""Scope key telling routes whether the caller presented a valid key (or none is needed)."""
API_KEY = "gateway.api_key"
"""Scope key holding the id of the request's API key (``ApiKey.id``), when keys are configured."""


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The API key a request presents (``Authorization: Bearer <key>`` or ``X-API-Key: <key>``,
    lower-case names: HTTP's scope and gRPC's metadata), or b""."""
    presented = b""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            presented = value[7:].strip()
        elif name == b"x-api-key":
            presented = value.strip()
    return presented


def match_key(keys: list[ApiKey], presented: bytes) -> ApiKey | None:
    """The configured key ``presented`` is, compared in constant time against every one (no early
    exit); None for none, and for an empty one."""
    matched = None
    for key in keys:
        if hmac.compare_digest(presented, key.secret):
            matched = key
    return matched if presented else None


class ApiKeyMiddleware:
    """Optional API keys: ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``, and each key's
    concurrency quota (its rate is spent where the images are counted, in ``api.handle_classify``).

    Keys are compared in constant time against every configured key (no early exit), and a missing
    key and a wrong one get the same answer, so nothing tells a caller which part failed. The
    matching key's id (never the key) is left in the scope under ``API_KEY``."""

    def __init__(
        self,
        app: ASGIApp,
        keys: list[ApiKey],
        open_paths: frozenset[str],
        metrics: Metrics,
        quotas: Quotas | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.metrics = metrics
        self.quotas = quotas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys:
            scope[AUTHENTICATED] = True
            await self.app(scope, receive, send)
            return
        key = match_key(self.keys, presented_key(scope["headers"]))
        scope[AUTHENTICATED] = key is not None
        if key is None:
            if scope["path"] in self.open_paths:
                await self.app(scope, receive, send)
                return
            error: GatewayError = Unauthorized(
                "a valid API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
            self.metrics.rejections.labels(error.error).inc()
            await error_response_for(scope["path"])(error)(scope, receive, send)
            return
        scope[API_KEY] = key.id
        if self.quotas is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            self.quotas.enter(key.id)
        except QuotaExceeded as exc:
            self.metrics.rejections.labels(exc.error).inc()
            self.metrics.quota_rejections.labels(key.id, "concurrency").inc()
            await error_response_for(scope["path"])(exc)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.quotas.leave(key.id)
