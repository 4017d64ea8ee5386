"""The composition root: ``create_app`` builds every part from the settings, and the lifespan opens
and closes them in order."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from service import __version__
from service.backends.base import Backend
from service.errors import GatewayError, error_body, error_response_for, validation_detail
from service.http import inference_protocol, model_routes
from service.http.answers import Answers
from service.http.api import Gateway, router
from service.http.docs_pages import add_docs_pages
from service.http.early import EarlyAdmission
from service.http.fastpath import FAST_ROUTES, ClassifyFastPath, refusal
from service.http.fetch import Fetcher
from service.http.middleware import (
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodyBudget,
    BodyLimitMiddleware,
    RequestMiddleware,
)
from service.http.quotas import Quotas
from service.http.refusing import EARLY_GATE, Gate
from service.jobs.client import JobsClient
from service.jobs.topology import Names
from service.metrics import Metrics, multiprocess_dir
from service.schemas import ModelInfo
from service.serving.catalog import Catalog, load_catalog
from service.serving.pipeline import open_models
from service.serving.reload import stamp, watch_models_file
from service.serving.served import ServedVersion
from service.settings import Settings
from service.ssrf import parse_allowlist
from service.tracing import Tracing

logger = logging.getLogger(__name__)

Front = Callable[[Gateway], AbstractAsyncContextManager[None]]
"""A server beside the HTTP app over the same gateway (its state, models, limits)."""


class GatewayApp(FastAPI):
    """FastAPI with the gateway's own layers (metrics, keys, body bounds, the /classify fast path)
    outermost, around the framework's whole stack rather than inside it: /classify then skips
    FastAPI's error, telemetry and body-limit layers, which it does not need (``ClassifyFastPath``
    answers every error itself)."""

    edge: Callable[[ASGIApp], ASGIApp] = staticmethod(lambda inner: inner)

    def build_middleware_stack(self) -> ASGIApp:
        return self.edge(super().build_middleware_stack())

    def openapi(self) -> dict[str, Any]:
        """FastAPI's description, without the 422 it adds to every route with a path parameter on
        the Open Inference Protocol's routes: a path parameter there is any string, and the routes
        that do answer 422 (an unknown query parameter) list it, in the protocol's shape."""
        schema = super().openapi()
        for path, operations in schema.get("paths", {}).items():
            if path.startswith("/v2"):
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if responses.get("422", {}).get("description") == "Validation Error":  # FastAPI's own
                        del responses["422"]
        return schema


def create_app(
    settings: Settings,
    *,
    backend: Backend | None = None,
    registry: CollectorRegistry | None = None,
    catalog: Catalog | None = None,
    fronts: Sequence[Front] = (),
) -> FastAPI:
    """Build the gateway. ``backend``, ``registry`` and ``catalog`` may be injected (tests); by
    default the backend and the models come from the settings and the registry is new. ``fronts``
    run beside the HTTP app over the same ``Gateway`` (the gRPC server: ``service.server``), from
    the models' start to the shutdown, which stops them first."""
    seen = stamp(settings.models_file) if settings.models_file is not None else None
    catalog = catalog if catalog is not None else load_catalog(settings)
    metrics = Metrics(registry)
    tracing = Tracing.from_settings(settings, role="gateway")
    keys = settings.load_api_keys()
    quotas = (
        Quotas(
            keys,
            settings.max_images_per_request,
            Path(shared) if settings.workers > 1 and (shared := multiprocess_dir()) else None,
        )
        if any(key.quota.limited for key in keys)
        else None
    )

    bodies = BodyBudget(settings.max_buffered_body_bytes_effective)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Gate]]:
        try:
            async with open_models(settings, metrics, backend, tracing, catalog) as models:
                jobs = (
                    JobsClient(
                        settings,
                        metrics,
                        tracing,
                        owners={key.id: key.secret for key in keys},
                        routes=Names(settings.queue_prefix).routes(models.models, models.default.name),
                    )
                    if settings.broker_url
                    else None
                )
                if jobs is not None:
                    jobs.start()  # in the background: online mode must not wait for the broker
                fetcher = (
                    Fetcher(
                        allow_http=settings.url_allow_http,
                        allowlist=parse_allowlist(settings.url_allowlist),
                        max_bytes=settings.url_max_bytes,
                        timeout=settings.url_timeout,
                        max_redirects=settings.url_max_redirects,
                        max_buffered_bytes=settings.max_buffered_body_bytes_effective,
                    )
                    if settings.url_inputs
                    else None
                )
                gateway = Gateway(
                    settings=settings,
                    models=models,
                    metrics=metrics,
                    answers={id(served): _answers(served) for served in models.versions()},
                    jobs=jobs,
                    quotas=quotas,
                    fetcher=fetcher,
                    key_models={key.id: key.quota.models for key in keys if key.quota.models is not None},
                    keys=keys,
                    tracing=tracing,
                )
                app.state.gateway = gateway
                # a version a reloaded models file adds has its renderer before a request can reach it
                models.on_added.append(lambda served: gateway.answers.__setitem__(id(served), _answers(served)))
                models.on_removed.append(partial(_forget, gateway.answers))
                if models.bodies is not None:
                    bodies.serve(models.bodies, models.default.name)
                unknown = {m for allowed in gateway.key_models.values() for m in allowed} - set(models.models)
                if unknown:  # a typo, or a model not served here (yet): its keys get 403 for it, not 404
                    logger.warning("API keys name models not served here: %s", ", ".join(sorted(unknown)))
                watcher = (
                    asyncio.create_task(watch_models_file(settings.models_file, models, settings, metrics, seen))
                    if settings.models_file is not None
                    else None
                )
                # What exists now (modules, the model, the label tables) lives as long as the process:
                # keep it out of the collector's full passes, which otherwise rescan it under load.
                gc.freeze()
                served = ", ".join(
                    f"{v.model}/{v.version} on {v.backend_name}" + ("" if v.state[0] == "ready" else f" ({v.state[0]})")
                    for v in models.versions()
                )
                if any(model.problem is None for model in models.models.values()):
                    logger.info("gateway ready: %s (default %s)", served, models.default.name)
                else:  # as /readyz says: listening, but no model can answer yet
                    logger.warning("gateway not ready, no model can answer: %s", served)
                try:
                    async with AsyncExitStack() as running:
                        for front in fronts:
                            await running.enter_async_context(front(gateway))
                        try:
                            # the HTTP protocol's refusals from the headers (uvicorn's lifespan state)
                            yield {EARLY_GATE: EarlyAdmission(gateway)}
                        finally:
                            gateway.closing = True  # not ready, while the fronts finish their calls
                finally:
                    gateway.closing = True
                    if watcher is not None:  # a reload under way stops here, before the models close
                        watcher.cancel()
                        await asyncio.gather(watcher, return_exceptions=True)
                    if jobs is not None:
                        await jobs.aclose()
                    if fetcher is not None:
                        await fetcher.aclose()
                    if quotas is not None:
                        quotas.close()
        finally:
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # exports what is buffered

    app = GatewayApp(
        title="Inference gateway",
        version=__version__,
        description="Image classification with dynamic batching in front of an inference backend.",
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry layer stays off: RequestMiddleware makes the server spans,
        # deciding sampling before any span work (FastAPI's layer does that work for every
        # request: at 1 % sampling it cost 17 % of the serving path's throughput), and Prometheus
        # and the gateway's log lines do metrics and logs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        docs_url=None,  # served from the gateway's own files (docs_pages), not from a CDN
        redoc_url=None,
    )
    add_docs_pages(app)
    app.include_router(router)
    app.include_router(model_routes.router)
    app.include_router(inference_protocol.router)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return refusal(exc, metrics, error_response_for(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejections.labels("invalid_parameters").inc()
        return JSONResponse(error_body("invalid_parameters", validation_detail(exc.errors())), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    templates = {template for fast in FAST_ROUTES for template in fast.templates}
    fast_routes = {
        path: route
        for route in (*router.routes, *model_routes.router.routes, *inference_protocol.router.routes)
        if (path := getattr(route, "path", "")) in templates and "POST" in getattr(route, "methods", ())
    }
    open_paths = OPEN_PATHS | ({"/metrics"} if settings.metrics_public else set())

    def edge(inner: ASGIApp) -> ASGIApp:
        app: ASGIApp = ClassifyFastPath(inner, routes=fast_routes, metrics=metrics)
        app = BodyLimitMiddleware(app, max_bytes=settings.max_body_bytes, budget=bodies, metrics=metrics)
        app = ApiKeyMiddleware(app, keys=keys, open_paths=open_paths, metrics=metrics, quotas=quotas)
        return RequestMiddleware(app, metrics=metrics, tracing=tracing)

    app.edge = edge
    return app


def _forget(answers: dict[int, Answers], served: ServedVersion) -> None:
    answers.pop(id(served), None)


def _answers(served: ServedVersion) -> Answers:
    """What renders ``served``'s online answers."""
    info = ModelInfo(name=served.model, version=served.version, random_weights=served.random_weights)
    return Answers(info, served.spec.profile.labels)
