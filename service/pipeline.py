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
from functools import partial

import cv2
import numpy as np

from service.allocator import keep_image_buffers
from service.backends.base import Backend
from service.backends.circuit import CircuitBreaker
from service.batcher import DynamicBatcher
from service.budget import ByteBudget
from service.classifier import RANKED, Classifier, Prepare, PrepareMany
from service.gpu import start_gpu_sampler
from service.health import BackendHealth
from service.metrics import Metrics
from service.models.checkpoints import real_weights_hint
from service.models.profiles import ModelProfile, get_profile, rank_rows
from service.models.store import ensure_model
from service.preprocess import PreprocessConfig, prepare
from service.settings import Settings
from service.tracing import Tracing

logger = logging.getLogger(__name__)


async def build_backend(settings: Settings, profile: ModelProfile) -> Backend:
    if settings.backend == "fake":
        from service.backends.fake import FakeBackend

        return FakeBackend(classes=len(profile.labels), delay=settings.fake_delay)
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
    if settings.backend == "torch" and settings.torch_engine == "shared" and settings.engine_socket:
        from service.backends.engine import EngineClient, Geometry

        return EngineClient(
            settings.engine_socket,
            Geometry(profile.image_size, len(profile.labels)),
            max_batch_size=settings.max_batch_size,
            slots=settings.max_inflight_batches,
            down_limit=settings.engine_down_limit,
        )
    if settings.backend == "torch":
        from service.backends.torch_backend import TorchBackend

        if profile.name != "resnet50":
            raise ValueError(f"the torch backend serves resnet50, not {profile.name}")
        return TorchBackend(
            settings.weights_for(profile.name),
            device=settings.torch_device,
            precision=settings.torch_precision,
            cuda_graphs=settings.torch_cuda_graphs,
            sync=settings.torch_sync,
            image_size=profile.image_size,
            max_batch_size=settings.max_batch_size,
            max_concurrency=settings.max_inflight_batches,
        )
    path = await asyncio.to_thread(ensure_model, settings.models_dir, profile, settings.weights_for(profile.name))
    if settings.backend == "openvino":
        from service.backends.openvino import OpenVINOBackend

        if settings.openvino_precision == "int8":
            from service.models.quantize import ensure_int8

            path = await asyncio.to_thread(ensure_int8, settings.models_dir, profile, path, settings.calibration_dir)
        return OpenVINOBackend(
            path,
            precision=settings.openvino_precision,
            threads=settings.embedded_threads_per_batch,
            max_concurrency=settings.max_inflight_batches,
        )
    from service.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(
        path, intra_op_threads=settings.embedded_threads_per_batch, max_concurrency=settings.max_inflight_batches
    )


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
        from service.gpu_decode import NvJpegDecoder

        gpu_decoder = NvJpegDecoder(settings.torch_device, metrics)
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
        rank=partial(rank_rows, k=RANKED),  # once per batch, not once per image on the event loop
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
    random_weights = profile.random_without_weights and settings.weights_for(profile.name) is None
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
