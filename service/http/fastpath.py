"""``POST /classify`` around FastAPI's layers, and the one way a refused request is counted and answered."""

from __future__ import annotations

import logging

from opentelemetry import trace
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import GatewayError, RequestTimeout, error_response
from service.http.api import handle_classify
from service.http.protocol import TIMED_OUT
from service.metrics import Metrics

logger = logging.getLogger(__name__)


class ClassifyFastPath:
    """``POST /classify`` straight to ``handle_classify``, around FastAPI's routing, dependency and
    exception layers (a third of the event loop's time per request on the serving-path benchmark).
    It sits inside the gateway's own middleware (body bounds, keys, metrics), renders errors exactly
    as the app's handlers do, and tags the scope with the documented route for the metrics and
    the server span."""

    def __init__(self, app: ASGIApp, route: BaseRoute, metrics: Metrics) -> None:
        self.app = app
        self.route = route
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/classify" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = self.route
        request = Request(scope, receive)
        try:
            response = await handle_classify(request)
        except ClientDisconnect:
            timed_out = scope.get(TIMED_OUT)
            if timed_out is None:
                return  # the client left: nobody to answer
            # The protocol has answered 408 and closed; this (dropped) answer tells the metrics.
            response = self._refusal(RequestTimeout(timed_out))
        except GatewayError as exc:
            response = self._refusal(exc)
        except Exception:  # outside FastAPI's error layer: answer 500 in the gateway's shape
            logger.exception("POST /classify failed")
            response = self._refusal(GatewayError("the gateway failed on this request; see its log"))
        await response(scope, receive, send)

    def _refusal(self, exc: GatewayError) -> Response:
        return refusal(exc, self.metrics)


def refusal(exc: GatewayError, metrics: Metrics) -> Response:
    """Count a refused request and answer it; a failure on the gateway's side (5xx) is also logged
    (rate-limited, with the request's ids) and marked on its span."""
    metrics.rejections.labels(exc.error).inc()
    if exc.status_code >= 500:
        logger.warning("request failed: %s (%d): %s", exc.error, exc.status_code, exc.detail)
    if (span := trace.get_current_span()).is_recording():
        span.set_attribute("gateway.error", exc.error)
    return error_response(exc)
