"""The classification pipeline both entry points share: backend, batcher, thread pool, classifier.

The HTTP app's lifespan and the queue worker each open one with ``open_pipeline`` and close it in
the right order (stop intake, drain the batcher, close the backend, stop the pool).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import cv2
import numpy as np

from service.backends.base import Backend
from service.backends.circuit import CircuitBreaker
from service.backends.factory import build_backend
from service.backends.health import BackendHealth
from service.batching.batcher import DynamicBatcher
from service.classifier import Classifier, Prepare, PrepareMany, rank_batch
from service.host.allocator import keep_image_buffers
from service.host.gpu import start_gpu_sampler
from service.images.budget import ByteBudget
from service.images.preprocess import PreprocessConfig, prepare
from service.metrics import Metrics
from service.models.checkpoints import real_weights_hint, weights_for
from service.models.profiles import get_profile
from service.settings import Settings
from service.tracing import Tracing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pipeline:
    classifier: Classifier
    backend: Backend
    health: BackendHealth


@asynccontextmanager
async def open_pipeline(
    settings: Settings, metrics: Metrics, backend: Backend | None = None, tracing: Tracing | None = None
) -> AsyncIterator[Pipeline]:
    """Start backend, batcher and preprocessing pool; on exit drain and close them in order."""
    profile = get_profile(settings.model)
    keep_image_buffers()  # this process churns through image-sized buffers from here on
    decode: Prepare = prepare  # before anything starts: a missing GPU decoder fails here, with nothing to undo
    decode_many: PrepareMany | None = None
    if settings.decoder == "nvjpeg":
        from service.images.gpu_decode import NvJpegDecoder

        gpu_decoder = NvJpegDecoder(settings.torch_device, lambda reason: metrics.decode_fallbacks.labels(reason).inc())
        decode, decode_many = gpu_decoder.prepare, gpu_decoder.prepare_many
        logger.info("decoder: JPEGs on %s (nvJPEG), other images on the CPU (OpenCV)", settings.torch_device)
    cv2.setNumThreads(1)  # parallelism comes from the preprocessing pool, one image per thread
    chosen = backend if backend is not None else await build_backend(settings, profile)
    if settings.breaker_threshold:
        probe = np.zeros((1, profile.image_size, profile.image_size, 3), np.uint8)
        chosen = CircuitBreaker(
            chosen, threshold=settings.breaker_threshold, cooldown=settings.breaker_cooldown, probe=probe
        )
    await chosen.start()
    batcher = DynamicBatcher(
        chosen.infer,
        max_batch_size=settings.max_batch_size,
        max_delay=settings.max_delay,
        max_queue_size=settings.max_queue_size,
        max_inflight_batches=settings.max_inflight_batches,
        on_batch=metrics.observe_batch,
        tracing=tracing,
        backend_name=chosen.name,
        policy=settings.batch_policy,
        rank=rank_batch,  # once per batch, not once per image on the event loop
        on_abandon=metrics.abandoned_images.inc,
    )
    metrics.bind_batcher(batcher, chosen.name)
    pool = ThreadPoolExecutor(max_workers=settings.preprocess_workers, thread_name_prefix="preprocess")
    config = PreprocessConfig(profile.image_size, profile.crop_fraction, settings.max_image_bytes)
    budget = ByteBudget(settings.max_decode_bytes_effective, on_wait=metrics.decode_budget_waits.inc)
    metrics.bind_decode_budget(budget)
    batcher.start()
    gpu = start_gpu_sampler(metrics.registry)
    metrics.gpus_visible = gpu.count if gpu is not None else 0
    health = BackendHealth(chosen, metrics, settings.readiness_interval)
    await health.refresh()
    watchers = [
        asyncio.create_task(health.run(), name="readiness"),
        asyncio.create_task(_sample(metrics), name="sampler"),
    ]
    logger.info("pipeline ready: model %s v%s on the %s backend", profile.name, profile.version, chosen.name)
    random_weights = profile.random_without_weights and weights_for(settings, profile.name) is None
    if random_weights:
        logger.warning(
            "model %s has RANDOM weights: its answers are meaningless (every answer says random_weights: true); %s",
            profile.name,
            real_weights_hint(profile.name),
        )
    classifier = Classifier(
        profile,
        batcher,
        pool,
        metrics,
        config,
        budget,
        tracing,
        random_weights=random_weights,
        decode=decode,
        decode_many=decode_many,
    )
    try:
        yield Pipeline(classifier, chosen, health)
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)  # no readiness call left in flight
        if gpu is not None:
            gpu.stop()
        await batcher.aclose(drain_timeout=settings.request_timeout)
        await chosen.aclose()
        pool.shutdown(wait=True, cancel_futures=True)


async def _sample(metrics: Metrics) -> None:
    """Keep the batcher's gauges current whether or not anyone scrapes."""
    while True:
        metrics.sample()
        await asyncio.sleep(1.0)
