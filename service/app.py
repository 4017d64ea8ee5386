"""The composition root: ``create_app`` builds every part from the settings, and the lifespan opens
and closes them in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import cv2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import __version__
from service.api import router
from service.backends.base import Backend
from service.batcher import DynamicBatcher
from service.classifier import Classifier
from service.errors import GatewayError, error_response
from service.metrics import Metrics
from service.middleware import BodyLimitMiddleware, MetricsMiddleware
from service.models.profiles import ModelProfile, get_profile
from service.models.store import ensure_model
from service.preprocess import PreprocessConfig
from service.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Everything a request handler needs, built once per app."""

    settings: Settings
    backend: Backend
    classifier: Classifier
    metrics: Metrics
    closing: bool = False


async def build_backend(settings: Settings, profile: ModelProfile) -> Backend:
    if settings.backend == "fake":
        from service.backends.fake import FakeBackend

        return FakeBackend(classes=len(profile.labels))
    if settings.backend == "triton":
        from service.backends.triton import TritonBackend

        return TritonBackend(
            url=settings.triton_url,
            model=settings.triton_model or profile.name,
            version=settings.triton_model_version,
            protocol=settings.triton_protocol,
            image_size=profile.image_size,
            classes=len(profile.labels),
            max_batch_size=settings.max_batch_size,
            shared_memory=settings.triton_shared_memory,
            shared_memory_regions=settings.max_inflight_batches,
        )
    from service.backends.embedded import EmbeddedBackend

    path = await asyncio.to_thread(ensure_model, settings.models_dir, profile, settings.model_weights)
    return EmbeddedBackend(
        path, intra_op_threads=settings.embedded_threads_per_batch, max_concurrency=settings.max_inflight_batches
    )


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body", "path", "header"))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def create_app(
    settings: Settings,
    *,
    backend: Backend | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """Build the gateway. ``backend`` and ``registry`` may be injected (tests); by default the
    backend comes from the settings and the registry is new."""
    profile = get_profile(settings.model)
    metrics = Metrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cv2.setNumThreads(1)  # parallelism comes from the preprocessing pool, one image per thread
        chosen = backend if backend is not None else await build_backend(settings, profile)
        await chosen.start()
        batcher = DynamicBatcher(
            chosen.infer,
            max_batch_size=settings.max_batch_size,
            max_delay=settings.max_delay,
            max_queue_size=settings.max_queue_size,
            max_inflight_batches=settings.max_inflight_batches,
            on_batch=metrics.observe_batch,
        )
        metrics.bind_batcher(batcher, chosen.name)
        pool = ThreadPoolExecutor(max_workers=settings.preprocess_workers, thread_name_prefix="preprocess")
        config = PreprocessConfig(profile.image_size, profile.crop_fraction, settings.max_image_pixels)
        gateway = Gateway(settings, chosen, Classifier(profile, batcher, pool, metrics, config), metrics)
        app.state.gateway = gateway
        batcher.start()
        logger.info("gateway ready: model %s v%s on the %s backend", profile.name, profile.version, chosen.name)
        try:
            yield
        finally:
            gateway.closing = True
            await batcher.aclose(drain_timeout=settings.request_timeout)
            await chosen.aclose()
            pool.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(
        title="Inference gateway",
        version=__version__,
        description="Image classification with dynamic batching in front of an inference backend.",
        lifespan=lifespan,
    )
    app.include_router(router)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        metrics.rejections.labels(exc.error).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejections.labels("invalid_parameters").inc()
        return JSONResponse({"error": "invalid_parameters", "detail": _validation_detail(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            {"error": code, "detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers
        )

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
