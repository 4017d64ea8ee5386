"""Prometheus metrics of the gateway, on a registry injected by the composition root."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from service.batcher import BatchReport, DynamicBatcher

# 1 ms to 10 s, roughly x2.5 per step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.gpus_visible = 0
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
            "Whole HTTP request latency, by route and status class (2xx, 4xx, 5xx).",
            ["route", "status_class"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.images = Counter(
            "gateway_images_classified_total",
            "Images classified, by mode: online (HTTP) or offline (queue worker).",
            ["mode"],
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
            "1 when the backend (Triton, or the embedded model) is ready to serve, else 0.",
            ["backend"],
            registry=r,
        )
        self.preprocess_duration = Histogram(
            "gateway_preprocess_duration_seconds",
            "Decode and resize time per image.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time an image waited in the batcher before its batch left.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_duration = Histogram(
            "gateway_backend_duration_seconds",
            "Backend call latency per batch, by backend.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "gateway_backend_errors_total",
            "Failed backend calls, by backend and error code.",
            ["backend", "error"],
            registry=r,
        )
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Images per backend batch.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("gateway_batcher_queue_depth", "Images waiting in the batcher.", registry=r)
        self.inflight_batches = Gauge(
            "gateway_batcher_inflight_batches", "Batches currently in the backend.", registry=r
        )
        self.rejections = Counter(
            "gateway_rejections_total",
            "Requests refused, by reason (the error code in the body).",
            ["reason"],
            registry=r,
        )

        self.queue_messages = Counter(
            "gateway_queue_messages_total",
            "Offline-mode messages by event: published, consumed, acked, requeued, retried, dead_lettered, "
            "results_published.",
            ["event"],
            registry=r,
        )
        self.queue_depth_messages = Gauge(
            "gateway_queue_depth_messages",
            "Messages ready in a broker queue, sampled by the worker.",
            ["queue"],
            registry=r,
        )

        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes...
        for mode in ("online", "offline"):
            self.images.labels(mode)
        for event in ("published", "consumed", "acked", "requeued", "retried", "dead_lettered", "results_published"):
            self.queue_messages.labels(event)
        for reason in (
            "bad_image",
            "bad_request",
            "payload_too_large",
            "unsupported_media_type",
            "invalid_parameters",
            "queue_full",
            "deadline_exceeded",
            "backend_unavailable",
            "backend_error",
            "unauthorized",
            "not_found",
        ):
            self.rejections.labels(reason)

    def bind_batcher(self, batcher: DynamicBatcher, backend: str) -> None:
        """Read the batcher's gauges at scrape time and return a per-batch callback."""
        self.queue_depth.set_function(lambda: batcher.queue_depth)
        self.inflight_batches.set_function(lambda: batcher.inflight_batches)
        self.backend_duration.labels(backend)
        self._backend = backend

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_size.observe(report.size)
        self.backend_duration.labels(self._backend).observe(report.backend_seconds)
        for wait in report.queue_waits:
            self.queue_wait.observe(wait)
        if report.error is not None:
            self.backend_errors.labels(self._backend, report.error).inc()
