"""The online inference routes around FastAPI's layers, and the one way a refused request is counted and answered.

An online request whose client disconnects is cancelled: the gateway's HTTP protocol
(``service.http.protocol``) calls back when the connection is lost and the request's task is
cancelled, so its images leave the batcher's queue (and their batch, if it was not sent) or its
URL fetches stop, and nobody computes an answer nobody reads (``gateway_client_disconnects_total``,
``gateway_abandoned_images_total``). uvicorn reads the socket while a request is handled, so a
closed connection (or a client's half-close) is seen at once. A callback, not a task per request
awaiting ``http.disconnect``: that task cost 9 % of the serving path's throughput."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import GatewayError, RequestTimeout, error_response
from service.http.api import CANCEL_ON_DISCONNECT, LABELS, VECTORS, Wants, handle_classify, handle_embed
from service.http.inference_protocol import handle_infer, protocol_error
from service.http.middleware import CLIENT_LEFT
from service.http.protocol import ON_DISCONNECT, TIMED_OUT
from service.metrics import Metrics

logger = logging.getLogger(__name__)


Handler = Callable[[Request, str | None, str | None], Awaitable[Response]]
"""A route's work: the request, and the model and version its path names (None: not named)."""
ErrorRenderer = Callable[[GatewayError], Response]


@dataclass(frozen=True)
class FastRoute:
    """An online route served around FastAPI's layers: its path, the route templates it is counted
    under (without and with a version), its work, and the shape of its errors."""

    prefix: str
    """What every path of the route starts with (a cheap test before the pattern's)."""
    pattern: re.Pattern[str]
    """The whole path; groups ``model`` and ``version`` where the path names them."""
    templates: tuple[str, str]
    handle: Handler
    render: ErrorRenderer = error_response
    wants: Wants | None = None
    """An image route's ``Wants`` (its query and the model's kind of output, checked before
    admission); None: the protocol's infer route, which takes no query parameter."""


def _classify(request: Request, model: str | None, version: str | None) -> Awaitable[Response]:
    return handle_classify(request, model, version)


def _embed(request: Request, model: str | None, version: str | None) -> Awaitable[Response]:
    assert model is not None  # the pattern names it
    return handle_embed(request, model, version)


def _infer(request: Request, model: str | None, version: str | None) -> Awaitable[Response]:
    assert model is not None  # the pattern names it
    return handle_infer(request, model, version)


FAST_ROUTES = (
    FastRoute("/classify", re.compile("/classify"), ("/classify", "/classify"), _classify, wants=LABELS),
    FastRoute(
        "/v1/models/",
        re.compile(r"/v1/models/(?P<model>[^/]+)/(?:versions/(?P<version>[^/]+)/)?classify"),
        ("/v1/models/{name}/classify", "/v1/models/{name}/versions/{version}/classify"),
        _classify,
        wants=LABELS,
    ),
    FastRoute(
        "/v1/models/",
        re.compile(r"/v1/models/(?P<model>[^/]+)/(?:versions/(?P<version>[^/]+)/)?embed"),
        ("/v1/models/{name}/embed", "/v1/models/{name}/versions/{version}/embed"),
        _embed,
        wants=VECTORS,
    ),
    FastRoute(
        "/v2/models/",
        re.compile(r"/v2/models/(?P<model>[^/]+)/(?:versions/(?P<version>[^/]+)/)?infer"),
        ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"),
        _infer,
        protocol_error,
    ),
)
"""``/classify``, the models' classify and embed routes, and the Open Inference Protocol's infer routes."""


def fast_route(path: str) -> tuple[FastRoute, str | None, str | None] | None:
    """The online route ``path`` is, with the model and version it names (None: not named); None
    for any other path."""
    for fast in FAST_ROUTES:
        if path.startswith(fast.prefix) and (match := fast.pattern.fullmatch(path)):
            named = match.groupdict()
            return fast, named.get("model"), named.get("version")
    return None


class ClassifyFastPath:
    """The online inference routes (``FAST_ROUTES``) straight to their work, around FastAPI's
    routing, dependency and exception layers (a third of the event loop's time per request on the
    serving-path benchmark), each with the same disconnect handling: a client that leaves is not
    answered, its work is cancelled and it is counted 499; a body too slow is counted 408. It sits
    inside the gateway's own middleware (body bounds, keys, metrics), renders errors in each
    route's shape (the gateway's, or the protocol's), and tags the scope with the documented route
    for the metrics and the server span."""

    def __init__(self, app: ASGIApp, routes: dict[str, BaseRoute], metrics: Metrics) -> None:
        """``routes``: the documented routes by path template (every template of ``FAST_ROUTES``)."""
        self.app = app
        self.routes = routes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if (found := fast_route(path)) is None:
            await self.app(scope, receive, send)
            return
        fast, model, version = found
        scope["route"] = self.routes[fast.templates[version is not None]]
        watch = _DisconnectWatch(scope)
        request = Request(scope, receive)
        try:
            response = await fast.handle(request, model, version)
        except asyncio.CancelledError:
            if not watch.left():
                raise
            watch.forgive()
            scope[CLIENT_LEFT] = True
            self.metrics.client_disconnects.inc()
            return  # nobody to answer
        except ClientDisconnect:
            timed_out = scope.get(TIMED_OUT)
            if timed_out is None:
                scope[CLIENT_LEFT] = True
                return  # the client left: nobody to answer
            # The protocol has answered 408 and closed; this (dropped) answer tells the metrics.
            response = refusal(RequestTimeout(timed_out), self.metrics, fast.render)
        except GatewayError as exc:
            response = refusal(exc, self.metrics, fast.render)
        except Exception:  # outside FastAPI's error layer: answer 500 in the route's shape
            logger.exception("POST %s failed", path)
            response = refusal(
                GatewayError("the gateway failed on this request; see its log"), self.metrics, fast.render
            )
        finally:
            watch.stop()
        await response(scope, receive, send)


class _DisconnectWatch:
    """Cancels the request's task when its client disconnects while the request is handled and
    may be cancelled (``CANCEL_ON_DISCONNECT``, set once its mode is known): the HTTP protocol calls
    ``ON_DISCONNECT`` when the connection is lost (no task, no wrapper around ``receive``)."""

    __slots__ = ("_left", "_scope", "_task")

    def __init__(self, scope: Scope) -> None:
        self._scope = scope
        self._task: asyncio.Task[Any] | None = asyncio.current_task()
        self._left = False
        scope[ON_DISCONNECT] = self._gone

    def _gone(self) -> None:
        """The connection is lost (the protocol calls this on the loop, while the request's task
        is suspended inside the handler: ``stop`` disarms it before anything else can await)."""
        # a body too slow is the protocol's to answer (408, TIMED_OUT): the app counts it as such
        if self._task is not None and self._scope.get(CANCEL_ON_DISCONNECT) and TIMED_OUT not in self._scope:
            self._left = True
            self._task.cancel()

    def left(self) -> bool:
        """Whether the request was cancelled because its client left."""
        return self._left

    def forgive(self) -> None:
        """The cancel was ours and is handled: the task goes on (uvicorn finishes the cycle)."""
        if self._task is not None:
            self._task.uncancel()

    def stop(self) -> None:
        """The handler is done (answered, refused or cancelled): watch no more."""
        self._scope.pop(ON_DISCONNECT, None)
        self._task = None


def refusal(exc: GatewayError, metrics: Metrics, render: ErrorRenderer = error_response) -> Response:
    """Count a refused request and answer it (in ``render``'s shape); a failure on the gateway's
    side (5xx) is also logged (rate-limited, with the request's ids) and marked on its span."""
    metrics.rejections.labels(exc.error).inc()
    if exc.status_code >= 500:
        logger.warning("request failed: %s (%d): %s", exc.error, exc.status_code, exc.detail)
    if (span := trace.get_current_span()).is_recording():
        span.set_attribute("gateway.error", exc.error)
    return render(exc)
