"""Prometheus metrics of the gateway, on a registry injected by the composition root."""

from __future__ import annotations

import os
import platform
import re
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    multiprocess,
)
from prometheus_client.exposition import choose_encoder

from service import __version__
from service.host.stages import stage_histogram, stage_observer

if TYPE_CHECKING:  # metrics is below the parts it observes: it only reads them
    from service.batching.batcher import DynamicBatcher
    from service.batching.items import BatchReport
    from service.images.budget import ByteBudget


# 1 ms to 10 s, roughly x2.5 per step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MODEL_LABELS = ["model", "version"]
"""Labels of the per-model series: bounded by the models file (at most 32 models x 8 versions)."""

disable_created_metrics()  # type: ignore[no-untyped-call]
"""No ``*_created`` series beside counters and histograms: a timestamp per series that no query of
ours reads, which doubled the exposition's counter lines (prometheus_client exports them by default)."""


def multiprocess_dir() -> str | None:
    """Set (before prometheus_client is imported) when uvicorn runs several worker processes."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.gpus_visible = 0
        self._models: list[ModelMetrics] = []
        """GPUs NVML sees in this process (0: no GPU series are exported)."""
        r = self.registry
        self.http_requests = Counter(
            "gateway_http_requests_total",
            "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "gateway_http_request_duration_seconds",
            "Whole HTTP request latency, by route and status code (the label of gateway_http_requests_total).",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grpc_requests = Counter(
            "gateway_grpc_requests_total",
            "gRPC calls answered (a streamed inference: each of its requests), by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.grpc_duration = Histogram(
            "gateway_grpc_request_duration_seconds",
            "Whole gRPC call latency (a streamed inference: each of its requests), by method and status code.",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.images = Counter(
            "gateway_images_classified_total",
            "Images classified, by mode (online: HTTP; offline: queue worker), model and version.",
            ["mode", *MODEL_LABELS],
            registry=r,
        )
        self.postprocess_duration = Histogram(
            "gateway_postprocess_duration_seconds",
            "Top-k selection and response building per request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_ready = Gauge(
            "gateway_backend_ready",
            "1 when a model version's backend (Triton, or the in-process model) is ready to serve, else 0.",
            ["backend", *MODEL_LABELS],
            registry=r,
            multiprocess_mode="livemin",  # with several workers: ready only if every live one is
        )
        self.preprocess_duration = Histogram(
            "gateway_preprocess_duration_seconds",
            "Decode and resize time per image.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stages = stage_histogram(r)
        self.observe_stage = stage_observer(self.stages)
        """``observe(stage, seconds)``: ``service.host.stages``."""
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time an image waited in the batcher before its batch left, by model and version.",
            MODEL_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_duration = Histogram(
            "gateway_backend_duration_seconds",
            "Backend call latency per batch, by backend, model and version.",
            ["backend", *MODEL_LABELS],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "gateway_backend_errors_total",
            "Failed backend calls, by backend, error code, model and version.",
            ["backend", "error", *MODEL_LABELS],
            registry=r,
        )
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Images per backend batch, by model and version.",
            MODEL_LABELS,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "gateway_batcher_queue_depth",
            "Images waiting in a model version's batcher.",
            MODEL_LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.inflight_batches = Gauge(
            "gateway_batcher_inflight_batches",
            "Batches currently in a model version's backend.",
            MODEL_LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.decode_reserved_bytes = Gauge(
            "gateway_decode_reserved_bytes",
            "Decoder memory reserved by the images being decoded (GATEWAY_MAX_DECODE_BYTES bounds it).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.decode_budget_waits = Counter(
            "gateway_decode_budget_waits",
            "Images that waited for decoder memory held by others (raise GATEWAY_MAX_DECODE_BYTES if it grows).",
            registry=r,
        )
        self.decode_fallbacks = Counter(
            "gateway_decode_fallbacks_total",
            "GATEWAY_DECODER=nvjpeg: images decoded by OpenCV instead, by reason (format: not a JPEG; "
            "refused: the GPU decoder failed on it).",
            ["reason"],
            registry=r,
        )
        self.engine_images = Counter(
            "gateway_engine_images_total",
            "GATEWAY_TORCH_ENGINE=shared: images this worker handed the engine, by path (cell: decoded into the "
            "engine's memory and sent as they were; copied: into a batch slot first, because the worker's cells "
            "were all taken or a GPU decoder made them).",
            ["path"],
            registry=r,
        )
        self.batch_model = Gauge(
            "gateway_batch_model_seconds",
            "Adaptive batching: the backend's batch time learned as a*n + b; term=per_image is a, "
            "term=per_batch is b (absent with the fixed policy, NaN until learned).",
            ["term", *MODEL_LABELS],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.batch_target = Gauge(
            "gateway_batch_target_size",
            "Images the batcher last waited for while the backend was busy (fixed: max_batch_size).",
            MODEL_LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.arrivals = Counter(
            "gateway_batcher_arrivals_total",
            "Images queued in a model version's batcher (rate() of it: the arrival rate; counted each second).",
            MODEL_LABELS,
            registry=r,
        )
        self.build_info = Gauge(
            "gateway_build_info",
            "Always 1: the gateway's version and Python's, as labels.",
            ["version", "python"],
            registry=r,
            multiprocess_mode="max",
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.http_in_flight = Gauge(
            "gateway_http_requests_in_flight",
            "HTTP requests being handled (admitted past the protocol's own refusals, not yet answered).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_prediction = Histogram(
            "gateway_batch_prediction_ratio",
            "Adaptive batching: each batch's actual backend seconds / the model's prediction (1 is exact).",
            MODEL_LABELS,
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=r,
        )
        self.rejections = Counter(
            "gateway_rejections_total",
            "Requests refused, by reason (the error code in the body).",
            ["reason"],
            registry=r,
        )
        self.model_reloads = Counter(
            "gateway_model_reloads_total",
            "Changes of the models file (GATEWAY_MODELS_FILE) seen: applied (new traffic weights, shares) "
            "or refused (anything else changed, or the file is invalid: the running weights stay).",
            ["outcome"],
            registry=r,
        )
        self.model_loads = Counter(
            "gateway_model_loads_total",
            "Loads of model versions on first use (GATEWAY_MODEL_MEMORY_BUDGET), by outcome: loaded, failed, "
            "refused (its memory held by models in use).",
            [*MODEL_LABELS, "outcome"],
            registry=r,
        )
        self.model_unloads = Counter(
            "gateway_model_unloads_total",
            "Model versions unloaded to make room in GATEWAY_MODEL_MEMORY_BUDGET (least recently used first).",
            MODEL_LABELS,
            registry=r,
        )
        self.model_memory = Gauge(
            "gateway_model_memory_bytes",
            "Memory a loaded in-process model version holds in the budget (0: not loaded).",
            MODEL_LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.model_memory_budget = Gauge(
            "gateway_model_memory_budget_bytes",
            "GATEWAY_MODEL_MEMORY_BUDGET (0: no budget, every model loaded at start).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects_total",
            "Online requests whose client disconnected before the answer: the request is cancelled, its "
            "images leave the queue (and their batch, if it was not sent yet).",
            registry=r,
        )
        self.abandoned_images = Counter(
            "gateway_abandoned_images_total",
            "Images of cancelled requests (their client went away) dropped before the backend saw them.",
            registry=r,
        )
        self.quota_rejections = Counter(
            "gateway_quota_rejections_total",
            "Requests refused because their API key was over a quota, by key (the first 12 hex digits of "
            "its SHA-256) and limit (rate, concurrency).",
            ["key", "limit"],
            registry=r,
        )
        self.key_images = Counter(
            "gateway_key_images_total",
            "Images admitted under each API key, when any key has a quota (key: its SHA-256 prefix).",
            ["key"],
            registry=r,
        )

        self.queue_messages = Counter(
            "gateway_queue_messages_total",
            "Offline-mode messages by event: published, consumed, acked, rejected, requeued, retried, dead_lettered, "
            "results_published, webhooks_published.",
            ["event"],
            registry=r,
        )
        self.webhook_deliveries = Counter(
            "gateway_webhook_deliveries_total",
            "Completion webhook attempts by outcome: delivered (2xx), retried (to be tried again), "
            "undeliverable (given up: dead-lettered).",
            ["outcome"],
            registry=r,
        )
        self.webhook_latency = Histogram(
            "gateway_webhook_latency_seconds",
            "From a job's end to its webhook's accepted delivery, retries included.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 21600.0),
            registry=r,
        )
        self.queue_depth_messages = Gauge(
            "gateway_queue_depth_messages",
            "Messages ready in a broker queue, sampled by the worker.",
            ["queue"],
            registry=r,
            multiprocess_mode="max",
        )

        self.multiprocess = multiprocess_dir() is not None
        if not self.multiprocess:  # in multiprocess mode, exposition() adds the answering process's
            ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes...
        self.queue_events = {
            event: self.queue_messages.labels(event)
            for event in (
                "published",
                "consumed",
                "acked",
                "rejected",
                "requeued",
                "rerouted",
                "retried",
                "dead_lettered",
                "results_published",
                "webhooks_published",
                "publish_retried",
            )
        }
        """``queue_messages``'s children by event, looked up once (``labels()`` takes a lock and checks
        its values: on the worker's path that was three calls per message)."""
        for outcome in ("delivered", "retried", "undeliverable"):
            self.webhook_deliveries.labels(outcome)
        for reason in (
            "bad_image",
            "bad_request",
            "payload_too_large",
            "unsupported_media_type",
            "invalid_parameters",
            "queue_full",
            "quota_exceeded",
            "idempotency_conflict",
            "deadline_unmeetable",
            "deadline_exceeded",
            "backend_unavailable",
            "model_not_loaded",
            "forbidden",
            "conflict",
            "backend_error",
            "unauthorized",
            "not_found",
        ):
            self.rejections.labels(reason)

    def model(self, name: str, version: str, backend: str) -> ModelMetrics:
        """The series of one served model version, bound once (``labels()`` takes a lock)."""
        served = ModelMetrics(self, name, version, backend)
        self._models.append(served)
        return served

    def bind_decode_budget(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.sample()

    def sample(self) -> None:
        for served in self._models:
            served.sample()
        budget = getattr(self, "_budget", None)
        if budget is not None:
            self.decode_reserved_bytes.set(budget.reserved)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The body and content type for /metrics: this registry, or with several uvicorn workers
        the sum over every worker's files (counters and histograms added, gauges per their mode).

        In the format the scraper's ``Accept`` asks for: Prometheus text by default, OpenMetrics
        (which carries the latency histograms' trace-id exemplars) when asked. Exemplars are kept
        by a single process only: prometheus_client's multiprocess files do not hold them."""
        self.sample()
        encoder, content_type = choose_encoder(accept)
        if not self.multiprocess:
            return encoder(self.registry), content_type
        forget_dead_processes(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        ProcessCollector(registry=registry)  # the answering worker's own process
        return encoder(registry), content_type


class ModelMetrics:
    """One model version's series: its images, batches, backend calls and batcher gauges."""

    def __init__(self, metrics: Metrics, model: str, version: str, backend: str) -> None:
        self.backend = backend
        labels = (model, version)
        self.images_online = metrics.images.labels("online", *labels)
        self.images_offline = metrics.images.labels("offline", *labels)
        self.ready = metrics.backend_ready.labels(backend, *labels)
        self._batch_size = metrics.batch_size.labels(*labels)
        self._prediction = metrics.batch_prediction.labels(*labels)
        self._backend_duration = metrics.backend_duration.labels(backend, *labels)
        self._backend_errors = metrics.backend_errors
        self._labels = labels
        self._queue_wait = metrics.queue_wait.labels(*labels)
        self._queue_depth = metrics.queue_depth.labels(*labels)
        self._inflight = metrics.inflight_batches.labels(*labels)
        self._target = metrics.batch_target.labels(*labels)
        self._per_image = metrics.batch_model.labels("per_image", *labels)
        self._per_batch = metrics.batch_model.labels("per_batch", *labels)
        self._arrivals = metrics.arrivals.labels(*labels)
        self._arrived = 0
        """The batcher's arrivals already counted."""
        self._batcher: DynamicBatcher | None = None

    def bind(self, batcher: DynamicBatcher) -> None:
        """The batcher whose gauges ``sample`` copies (set_function gauges do not work in
        multiprocess mode, so they are sampled instead). A new batcher (a reload) counts its
        arrivals from its own zero, once the old one's last are counted."""
        if batcher is not self._batcher:
            self.sample()
            self._batcher, self._arrived = batcher, 0
        self.sample()

    def sample(self) -> None:
        batcher = self._batcher
        if batcher is None:
            return
        self._queue_depth.set(batcher.queue_depth)
        self._inflight.set(batcher.inflight_batches)
        self._target.set(batcher.target)
        if (new := batcher.arrived - self._arrived) > 0:
            self._arrivals.inc(new)
            self._arrived = batcher.arrived
        if batcher.model is not None:
            fit = batcher.model.fit
            self._per_image.set(fit.a if fit else float("nan"))
            self._per_batch.set(fit.b if fit else float("nan"))

    def observe_batch(self, report: BatchReport) -> None:
        self._batch_size.observe(report.size)
        if report.predicted_seconds and report.error is None:
            self._prediction.observe(report.backend_seconds / report.predicted_seconds)
        # exemplars: each image's trace id when sampled; the batch's span is in the first one's trace
        trace_ids = report.trace_ids or [None] * len(report.queue_waits)
        first = next((t for t in trace_ids if t is not None), None)
        self._backend_duration.observe(report.backend_seconds, {"trace_id": first} if first is not None else None)
        for wait, trace_id in zip(report.queue_waits, trace_ids, strict=True):
            self._queue_wait.observe(wait, {"trace_id": trace_id} if trace_id is not None else None)
        if report.error is not None:
            self._backend_errors.labels(self.backend, report.error, *self._labels).inc()


_LIVE_FILE = re.compile(r"gauge_live(?:sum|all|max|min|mostrecent)_(\d+)\.db")


def forget_dead_processes(directory: str) -> None:
    """Drop the live gauges of worker processes that are gone (killed, crashed, restarted by
    uvicorn): prometheus_client's ``mark_process_dead``, for every pid whose ``live`` files remain
    and that no longer runs. Without it a dead worker's requests in flight stayed in the sum."""
    for entry in os.listdir(directory):
        if (found := _LIVE_FILE.fullmatch(entry)) is None:
            continue
        pid = int(found.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except PermissionError:
            pass  # a process runs there (another user's): not ours to judge
