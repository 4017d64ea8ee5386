"""The models both entry points serve, started: per model version a backend, batcher and
classifier; one decode pool and byte budget shared by them all.

The HTTP app's lifespan and the queue worker each open them with ``open_models`` and close them in
the right order (stop intake, drain the batchers, close the backends, stop the pool).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import cv2
import numpy as np

from service.backends.base import Backend
from service.backends.capabilities import capabilities_of
from service.backends.circuit import CircuitBreaker
from service.backends.engine import EngineClient
from service.backends.factory import build_backend
from service.backends.health import BackendHealth
from service.backends.triton_repository import TritonRepository
from service.batching.batcher import DynamicBatcher
from service.classifier import Classifier, Prepare, PrepareMany, rank_for
from service.errors import ModelNotLoaded
from service.host.allocator import keep_image_buffers
from service.host.gpu import start_gpu_sampler
from service.host.stages import PauseWatch
from service.images.budget import Budget, BudgetShare, ByteBudget
from service.images.preprocess import prepare
from service.metrics import Metrics
from service.models.checkpoints import real_weights_hint
from service.serving.catalog import Catalog, ModelSpec, VersionSpec, load_catalog
from service.serving.discovery import with_discovered
from service.serving.fair import Admission, FairPool, Lane
from service.serving.loading import Loader
from service.serving.registry import ServedModels
from service.serving.served import Running, ServedModel, ServedVersion
from service.serving.statistics import both
from service.settings import Settings
from service.tracing import Tracing

logger = logging.getLogger(__name__)


@asynccontextmanager
async def open_models(
    settings: Settings,
    metrics: Metrics,
    backend: Backend | None = None,
    tracing: Tracing | None = None,
    catalog: Catalog | None = None,
) -> AsyncIterator[ServedModels]:
    """Start every model version of the catalog (by default the settings'): one decode pool and
    byte budget shared fairly between the models, and per version its backend, batcher and
    readiness check; on exit drain and close them in order. ``backend`` (tests) replaces the
    default model's backend when the catalog serves one version."""
    catalog = catalog if catalog is not None else load_catalog(settings)
    if catalog.discovery is not None:
        catalog = await _discover(catalog, settings)
    keep_image_buffers()  # this process churns through image-sized buffers from here on
    decode: Prepare = prepare  # before anything starts: a missing GPU decoder fails here, with nothing to undo
    decode_many: PrepareMany | None = None
    if settings.decoder != "opencv":
        from service.images.gpu_decode import NvImageCodecDecoder, NvJpegDecoder

        kind = NvJpegDecoder if settings.decoder == "nvjpeg" else NvImageCodecDecoder
        gpu_decoder = kind(settings.torch_device, lambda reason: metrics.decode_fallbacks.labels(reason).inc())
        decode, decode_many = gpu_decoder.prepare, gpu_decoder.prepare_many
        logger.info("decoder: JPEGs on %s (%s), other images on the CPU (OpenCV)", settings.torch_device, kind.__name__)
    cv2.setNumThreads(1)  # parallelism comes from the preprocessing pool, one image per thread
    pool = ThreadPoolExecutor(max_workers=settings.preprocess_workers, thread_name_prefix="preprocess")
    # a models file may gain models on reload: its gateway shares fairly from the start
    several = len(catalog.models) > 1 or settings.models_file is not None
    fair = FairPool(pool, settings.preprocess_workers) if several and settings.fair_sharing else None
    budget = ByteBudget(settings.max_decode_bytes_effective, on_wait=metrics.decode_budget_waits.inc)
    metrics.bind_decode_budget(budget)
    gpu = start_gpu_sampler(metrics.registry)
    metrics.gpus_visible = gpu.count if gpu is not None else 0
    lone = len(catalog.models) == 1 and len(catalog.models[0].versions) == 1
    assembly = Assembly(settings, metrics, tracing, pool, fair, budget, decode, decode_many)
    sampler = asyncio.create_task(_sample(metrics), name="sampler")
    pauses = PauseWatch(metrics.observe_stage)
    pauses.start()
    try:
        models = {spec.name: assembly.model(spec, backend if lone else None) for spec in catalog.models}
        every = [served for model in models.values() for served in model.versions.values()]
        loader = (
            Loader(settings.model_memory_budget, [v for v in every if v.lazy], assembly.start, assembly.stop, metrics)
            if assembly.budgeted
            else None
        )
        assembly.loader = loader
        shares = {spec.name: spec.share for spec in catalog.models}
        admission = Admission(
            settings.max_concurrent_requests, shares, fair=settings.fair_sharing, longest=settings.request_timeout
        )
        bodies = Admission(settings.max_buffered_body_bytes_effective, shares, fair=settings.fair_sharing)
        served_models = ServedModels(catalog, models, admission, loader, bodies)
        served_models.assembly = assembly
        for served in every:
            if not served.lazy:
                served.running = await assembly.start(served)
        if loader is not None:  # the default model's versions that take traffic, the heaviest first
            default = sorted(models[catalog.default].versions.values(), key=lambda v: -v.spec.traffic)
            for served in (v for v in default if v.lazy and v.spec.traffic > 0):
                try:
                    async with served_models.hold(served, None, admit=False):
                        pass  # loaded
                except ModelNotLoaded as exc:
                    logger.warning("models: not loaded at start: %s", exc)
                    break
        yield served_models
    finally:
        if assembly.loader is not None:
            await assembly.loader.aclose()  # the loads under way finish first: what they start is stopped below
        sampler.cancel()
        pauses.stop()
        await asyncio.gather(sampler, return_exceptions=True)
        if gpu is not None:
            gpu.stop()
        running = [served.running for served in assembly.versions.values() if served.running is not None]
        await asyncio.gather(*(assembly.stop(r) for r in running), return_exceptions=True)
        if fair is not None:
            fair.close()
        pool.shutdown(wait=True, cancel_futures=True)


class Assembly:
    """What starts and stops model versions, kept for the process's life: the versions found at
    start and those a reloaded models file adds (``service.serving.changes``) are made the same way,
    each model with its lane of the decode pool and its share of the decoder memory where sharing is
    fair, each version lazily loaded under a memory budget."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tracing: Tracing | None,
        pool: Executor,
        fair: FairPool | None,
        budget: ByteBudget,
        decode: Prepare,
        decode_many: PrepareMany | None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing
        self.pool = pool
        self.fair = fair
        self.budget = budget
        self.decode = decode
        self.decode_many = decode_many
        self.budgeted = settings.model_memory_budget > 0
        self.loader: Loader | None = None
        self.memory: dict[str, BudgetShare] = {}
        """Each model's share of the decoder memory budget, where sharing is fair."""
        self.versions: dict[int, ServedVersion] = {}
        """Every version made and not yet stopped for good (by ``id``): what shutdown stops."""
        self._backends: dict[int, Backend] = {}
        """A backend given for a version (tests), by ``id`` of the version."""

    def model(self, spec: ModelSpec, backend: Backend | None = None) -> ServedModel:
        """A model's versions, not started (its lane and memory share made); ``backend`` (tests)
        replaces its one version's backend."""
        executor: Executor = self.fair.lane(spec.share) if self.fair is not None else self.pool
        if self.fair is not None:
            self.memory[spec.name] = self.budget.share(spec.share)
        versions = {version.version: self.version(spec.name, version, executor, backend) for version in spec.versions}
        lane = executor if isinstance(executor, Lane) else None
        return ServedModel(spec, versions, lane=lane, memory=self.memory.get(spec.name))

    def version(
        self, model: str, spec: VersionSpec, executor: Executor, backend: Backend | None = None
    ) -> ServedVersion:
        """A version, not started: loaded on first use where the memory budget holds it."""
        capabilities = capabilities_of(spec.settings)
        label = backend.name if backend is not None else capabilities.name
        served = ServedVersion(
            model,
            spec,
            self.metrics.model(model, spec.version, label),
            executor,
            lazy=self.budgeted and capabilities.in_budget,  # Triton holds its own models
        )
        self.versions[id(served)] = served
        if backend is not None:
            self._backends[id(served)] = backend
        return served

    def drop_model(self, model: ServedModel) -> None:
        """A removed model's lane and memory share, once its versions have stopped."""
        if self.fair is not None and model.lane is not None:
            self.fair.drop(model.lane)
        if (share := self.memory.pop(model.name, None)) is not None:
            self.budget.drop(share)

    def forget(self, served: ServedVersion) -> None:
        """A version stopped for good (a reload retired it)."""
        self.versions.pop(id(served), None)
        self._backends.pop(id(served), None)

    async def start(self, served: ServedVersion) -> Running:
        reserve = self.memory.get(served.model, self.budget)
        backend = self._backends.get(id(served))
        return await _start_version(served, self.metrics, self.tracing, backend, reserve, self.decode, self.decode_many)

    async def stop(self, running: Running) -> None:
        await _stop_version(running, self.settings.request_timeout)


def _count_sent(metrics: Metrics, in_cells: int, copied: int) -> None:
    metrics.engine_images.labels("cell").inc(in_cells)
    metrics.engine_images.labels("copied").inc(copied)


async def _start_version(
    served: ServedVersion,
    metrics: Metrics,
    tracing: Tracing | None,
    backend: Backend | None,
    budget: Budget,
    decode: Prepare,
    decode_many: PrepareMany | None,
) -> Running:
    """One model version's backend (started), batcher, readiness check and classifier. If a step
    fails (the backend's start, most often), what the earlier ones opened is closed, in reverse
    order, before the error goes on: a load that fails leaves no backend threads or connections."""
    async with AsyncExitStack() as opened:
        name, spec = served.model, served.spec
        settings, profile = spec.settings, spec.profile
        chosen = backend if backend is not None else await build_backend(settings, profile)
        if decode is prepare:  # OpenCV decodes into the backend's memory where it has some (the engine's cells)
            decode = partial(prepare, into=chosen.allocate_image)
        if isinstance(chosen, EngineClient):
            chosen.on_sent = partial(_count_sent, metrics)
        if settings.breaker_threshold:
            probe = np.zeros((1, *profile.input_size, 3), np.uint8)
            chosen = CircuitBreaker(
                chosen, threshold=settings.breaker_threshold, cooldown=settings.breaker_cooldown, probe=probe
            )
        opened.push_async_callback(_quietly, served, chosen.aclose)  # a failed start may have opened threads
        await chosen.start()
        batcher = DynamicBatcher(
            chosen.infer,
            max_batch_size=settings.max_batch_size,
            max_delay=settings.max_delay,
            max_queue_size=settings.max_queue_size,
            max_inflight_batches=settings.max_inflight_batches,
            on_batch=both(served.metrics.observe_batch, served.statistics.observe_batch),
            tracing=tracing,
            backend_name=chosen.name,
            policy=settings.batch_policy,
            rank=rank_for(profile),  # once per batch, not once per image on the event loop
            on_abandon=metrics.abandoned_images.inc,
            # a free slot of a CPU runtime is idle cores (at 8 clients: 1.25x, p50 0.7x), and the shared
            # engine batches again: send at once
            busy_at=settings.max_inflight_batches if capabilities_of(settings).sends_at_once else 1,
            on_stage=metrics.observe_stage,
        )
        served.metrics.bind(batcher)
        batcher.start()
        opened.push_async_callback(_quietly, served, partial(batcher.aclose, drain_timeout=0))
        health = BackendHealth(chosen, served.metrics, settings.readiness_interval, name=f"{name}/{spec.version}")
        if (problem := await health.refresh()) is None:
            logger.info(
                "model %s version %s ready: %s on the %s backend", name, spec.version, profile.name, chosen.name
            )
        else:  # served once its backend can, without a restart: not ready, and not said to be
            logger.warning(
                "model %s version %s unavailable: %s on the %s backend: %s",
                name,
                spec.version,
                profile.name,
                chosen.name,
                problem,
            )
        random_weights = served.random_weights
        if random_weights:
            logger.warning(
                "model %s version %s (%s) has RANDOM weights: its answers are meaningless (every answer says "
                "random_weights: true); %s",
                name,
                spec.version,
                profile.name,
                real_weights_hint(profile.name),
            )
        classifier = Classifier(
            profile,
            batcher,
            served.executor,
            metrics,
            served.config,
            budget,
            tracing,
            random_weights=random_weights,
            decode=decode,
            decode_many=decode_many,
            name=name,
            version=spec.version,
        )
        watcher = asyncio.create_task(health.run(), name=f"readiness {name}/{spec.version}")
        opened.pop_all()  # started: from here on its owner stops it (_stop_version)
        return Running(classifier, chosen, health, watcher)


async def _quietly(served: ServedVersion, close: Callable[[], Awaitable[None]]) -> None:
    """Close what a failed start opened; a failure to close is logged, and the start's error goes on."""
    try:
        await close()
    except Exception as exc:
        logger.warning("model %s version %s: closing after a failed start: %s", served.model, served.version, exc)


async def _stop_version(running: Running, drain_timeout: float) -> None:
    running.watcher.cancel()
    await asyncio.gather(running.watcher, return_exceptions=True)  # no readiness call left in flight
    await running.classifier.batcher.aclose(drain_timeout=drain_timeout)
    await running.backend.aclose()


async def _discover(catalog: Catalog, settings: Settings) -> Catalog:
    """``catalog`` with the models of its Triton's repository index (see ``with_discovered``); an
    unreachable Triton leaves the file's models alone (discovery happens at start only)."""
    assert catalog.discovery is not None
    try:
        found = await TritonRepository(catalog.discovery.url, catalog.discovery.protocol).index()
        entries = [(e.name, e.version, e.state) for e in found]
        grown, skipped = await asyncio.to_thread(with_discovered, catalog, entries, settings)
    except Exception as exc:  # whatever Triton answers, the file's models are served
        logger.warning("models: Triton's repository index gave no models to serve: %s", exc)
        return catalog
    if skipped:
        shown = ", ".join(repr(name[:80]) for name in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        logger.warning("models: %d of Triton's models not served: %s%s", len(skipped), shown, more)
    logger.info(  # Triton's address: not at info (issue 46)
        "models: found in Triton's repository index: %s",
        ", ".join(grown.discovered) or "nothing the models file does not name",
    )
    return grown


async def _sample(metrics: Metrics) -> None:
    """Keep the batcher's gauges current whether or not anyone scrapes."""
    while True:
        metrics.sample()
        await asyncio.sleep(1.0)
