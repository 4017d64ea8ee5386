"""Refusing an online request from its request line and headers, before its body is read.

Past capacity, most requests are refused (429), and each one's client sends its next at once, often
with a photo of several hundred KB. A refusal made by the app costs what any request costs the
event loop (its task, the middleware, a response object) and then the upload it reads to reach the
next request: at 4x overload that was half of two cores, and the gateway delivered 0.6x its own
capacity. The HTTP protocol (``service.http.protocol``) therefore asks ``EarlyAdmission`` at the
end of each request's headers whether the request would be refused anyway, and if so answers it
itself: no ASGI task, no middleware, no decode, body budget or batcher work.

What is decided from the head alone, as the app decides it later:

* the route: the online inference routes (``FAST_ROUTES``: ``/classify``, a model's ``classify``
  and ``embed``, the protocol's ``infer``); every other request (and an upgrade) goes to the app;
* what the app would refuse first goes to the app, which answers it as before: a missing or wrong
  API key (401: whether the gateway is busy is not told to a caller without a key), an unknown
  model or version (404), a model the key may not use (403), a bad query or a model without the
  route's kind of output (``check_before_admission``), a query on ``infer``: a request that can
  never succeed is not told 429 and retried for ever;
* ``Content-Length``: over ``max_body_bytes``, 413;
* admission: no room for the model (``Admission.check``), 429 with ``Retry-After`` from the
  measured drain rate; with room, the slot is reserved for the request while its body arrives.

A refused request is counted as the app counts it (``gateway_rejections_total``, the route's
``gateway_http_requests_total`` and duration, its id in ``X-Request-ID`` and the body); it gets
no server span (it is refused in microseconds, before any work a trace would show).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

import httptools
from prometheus_client import Counter

from service.errors import GatewayError, QueueFull, error_body, printable
from service.http.api import check_before_admission
from service.http.fastpath import FAST_ROUTES, FastRoute, fast_route
from service.http.gateway import RESERVED, Gateway, choose
from service.http.middleware import (
    REQUEST_ID_HEADER,
    RequestSeries,
    client_request_id,
    declared_over,
    match_key,
    new_request_id,
    presented_key,
)
from service.http.refusing import EarlyAnswer

_PREFIXES = tuple({fast.prefix.encode() for fast in FAST_ROUTES})
"""What an online inference path starts with: a cheap test before parsing the URL."""


class EarlyAdmission:
    """The HTTP protocol's question at the end of a request's headers: is this an online inference
    request the gateway refuses (``EarlyAnswer``), or one for the app (None)?"""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_body_bytes = gateway.settings.max_body_bytes
        self.series = RequestSeries(gateway.metrics)
        self._rejections: dict[str, Counter] = {}
        """``gateway_rejections_total``'s children by reason (``labels()`` costs a lock)."""

    @staticmethod
    def _park(error: GatewayError) -> float:
        """How long a refused keep-alive connection is left unread: for a 429, the ``Retry-After``
        it was given (measured from the drain rate); a client that sends again sooner waits for it,
        at no cost to anyone."""
        return float(error.retry_after) if isinstance(error, QueueFull) else 0.0

    def __call__(
        self, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]], scope: dict[str, Any]
    ) -> EarlyAnswer | None:
        if method != b"POST" or not url.startswith(_PREFIXES):
            return None
        start = time.perf_counter()
        route = _route(url)
        if route is None:
            return None
        fast, model, version, query_string = route
        error = self._refusal(fast, model, version, query_string, headers, scope)
        if error is None:
            return None
        counter = self._rejections.get(error.error)
        if counter is None:
            counter = self._rejections[error.error] = self.gateway.metrics.rejections.labels(error.error)
        counter.inc()
        template = fast.templates[version is not None]
        request_id = None
        for name, value in headers:
            if name == REQUEST_ID_HEADER:
                request_id = client_request_id(value) or request_id
        request_id = request_id or new_request_id()
        answer = _render(error, request_id, self._park(error), protocol=fast.prefix == "/v2/models/")
        self.series.record(template, "POST", error.status_code, time.perf_counter() - start)
        return answer

    def _refusal(
        self,
        fast: FastRoute,
        model: str | None,
        version: str | None,
        query_string: bytes,
        headers: list[tuple[bytes, bytes]],
        scope: dict[str, Any],
    ) -> GatewayError | None:
        """Why the request is refused now, or None: admitted (its slot reserved in ``scope``, so
        that no request admitted while its body arrives takes it), or for the app to answer (it
        would refuse it for something else first: its key, model, version, query or the model's
        kind of output, each checked here as the app checks it)."""
        gateway = self.gateway
        if gateway.closing:
            return None
        key_id = None
        if gateway.keys:
            key = match_key(gateway.keys, presented_key(headers))
            if key is None:
                return None
            key_id = key.id
        models = gateway.models
        try:
            served = choose(gateway, key_id, model, version)  # 404, 403: the app's to answer
            if fast.wants is not None:
                check_before_admission(fast.wants, served, query_string)
            elif query_string:  # the protocol's infer takes no query parameter: the app's 422
                return None
        except GatewayError:
            return None
        if (too_large := declared_over(headers, self.max_body_bytes)) is not None:
            return too_large
        try:
            models.admission.check(served.model)
        except QueueFull as exc:
            return exc
        scope[RESERVED] = models.admission.reserve_slot(served.model)
        return None


def _route(url: bytes) -> tuple[FastRoute, str | None, str | None, bytes] | None:
    """The online route ``url`` names, the model and version its path names (None: the default,
    or by traffic weights) and its query string; None for another path (or a URL the parser
    refuses: the app answers it)."""
    try:
        parsed = httptools.parse_url(url)
    except httptools.HttpParserInvalidURLError:
        return None
    raw = parsed.path
    path = raw.decode("ascii", "surrogateescape")
    if "%" in path:
        path = urllib.parse.unquote(path)
    if (found := fast_route(path)) is None:
        return None
    return *found, parsed.query or b""


def _render(error: GatewayError, request_id: str, park: float, *, protocol: bool) -> EarlyAnswer:
    """The refusal in its route's shape (the protocol's ``{"error": ...}`` under ``/v2``, else the
    gateway's), with its headers."""
    shape = {"error": printable(error.detail)} if protocol else error_body(error.error, error.detail, request_id)
    headers = [("content-type", "application/json"), ("x-request-id", request_id)]
    headers += [(name.lower(), value) for name, value in error.headers.items()]
    return EarlyAnswer(error.status_code, headers, json.dumps(shape).encode(), park)
