"""The settings' fields, by concern: each group a model of its own, combined by ``Settings``
(``service.settings``) with the per-model group (``service.settings.model``), which reads them
from ``GATEWAY_*`` variables and checks the rules that span groups. A field's docstring is its
documentation (docs/settings.md, ``gateway settings``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from service.host.cpus import available_cpus


def _default_models_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inference-gateway" / "models"


DECODE_THREADS_PER_CPU = 2
"""Default decode threads per usable CPU (measured: ``python -m loadtests.serving_path --threads``)."""


class _Fields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class ServerFields(_Fields):
    """The HTTP server, its logs and traces, API keys and who may read the metrics."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds to (``0.0.0.0`` or ``::`` for every interface; an empty or blank value is
    refused, not read as every interface)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port of the HTTP server (0 picks a free one)."""
    grpc_port: int = Field(8001, ge=0, le=65535)
    """TCP port of the gRPC server, on ``host``: the Open Inference Protocol's
    ``inference.GRPCInferenceService``, as Triton serves it, so ``tritonclient.grpc`` and
    ``perf_analyzer`` work here unchanged (0: off). Every worker process serves it on the same port
    (``SO_REUSEPORT``: the kernel spreads the connections)."""
    grpc_max_concurrent_streams: int = Field(100, ge=1, le=100_000)
    """Calls one gRPC (HTTP/2) connection may have in progress at once; a client's further calls wait
    for its connection to free a stream (more connections do not pass the gateway's own limits)."""
    workers: int = Field(1, ge=1, le=64)
    """uvicorn worker processes. Each has its own batcher; with more than one, metrics are kept in
    Prometheus multiprocess mode and /metrics sums them over all workers."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the gateway's loggers and of uvicorn."""
    access_log: bool = False
    """uvicorn's access log, a line per request (off: the request metrics count every request,
    and a log line per image costs as much as the rest of a cheap request's path)."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text, or as one JSON object per line (for a log pipeline: ``timestamp``, ``level``,
    ``logger``, ``message``). Either way a line a request or job causes carries its ``request_id`` /
    ``job_id`` and, when traced, ``trace_id`` and ``span_id``."""
    log_repeat_interval: float = Field(10.0, ge=0.0)
    """Seconds during which further copies of one warning (same logger and message template) are dropped
    and counted, said on the next copy let through (0: every copy is written)."""
    tracing_endpoint: str | None = None
    """OTLP/HTTP collector URL for OpenTelemetry traces, e.g. ``http://otel-collector:4318``
    (spans are posted to ``/v1/traces`` under it). Unset: tracing is off and costs nothing."""
    tracing_service_name: str = "inference-gateway"
    """``service.name`` of the spans (each process also says its ``gateway.role``: gateway, worker or
    ingest)."""
    tracing_sample_ratio: float = Field(0.01, ge=0.0, le=1.0)
    """Share of new traces sampled. A request whose ``traceparent`` says its caller sampled it is
    always traced (and one whose caller did not, never), so a trace is whole or absent."""

    api_keys: SecretStr | None = None
    """Comma-separated API keys; when set (or ``api_keys_file`` is), every route but /healthz and
    /readyz needs one, as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``. Each key may be
    followed by its own quota: ``KEY rate=20 burst=40 concurrency=4``, the models it may use
    (``models=shop|moderation``; others 403) and its rate on one model within its own
    (``rate@shop=5``)."""
    api_keys_file: Path | None = None
    """File with one API key per line, each with its quota as in ``api_keys`` (e.g. a mounted
    Kubernetes Secret); adds to ``api_keys``. Read at start: a regular UTF-8 file of at most 64 MiB;
    a FIFO, a device, a directory or a bad entry stops the start with a message naming the setting."""
    key_rate: float = Field(0.0, ge=0.0)
    """Images per second each API key may send, unless its entry says ``rate=`` (0: unlimited).
    Over it: 429 ``quota_exceeded`` with ``Retry-After``."""
    key_burst: float = Field(0.0, ge=0.0)
    """Images a key may send at once after idling, unless its entry says ``burst=`` (0: one second
    of its rate, at least ``max_images_per_request``)."""
    key_concurrency: int = Field(0, ge=0)
    """Requests each API key may have in progress at once, unless its entry says
    ``concurrency=`` (0: unlimited; at most 256, here and in ``concurrency=``, checked with the keys at
    start)."""
    metrics_public: bool = False
    """Serve /metrics without an API key even when keys are configured (e.g. when only Prometheus
    can reach the port)."""


class ServingFields(_Fields):
    """The backends' process-wide options and the models served (what one model may set for itself
    is in ``service.settings.model``)."""

    torch_cuda_graphs: bool = True
    """Run the ``torch`` backend's batches as CUDA graphs captured at start (one per batch bucket and
    backend thread): one launch per batch instead of one per layer. Off: eager PyTorch. A failed capture
    falls back to eager, said in /readyz's ``runtime`` check."""
    torch_compile: Literal["off", "on", "max-autotune"] = "off"
    """Compile the ``torch`` backend's forward pass with ``torch.compile`` (Inductor, the weights frozen
    in): ``on``, or ``max-autotune`` (also times the kernels' configurations: minutes per batch bucket
    at start on a GPU). Each bucket compiles during the warm-up, before the backend says it is ready;
    the CUDA graphs then capture the compiled pass. Answers equal eager's within float tolerance."""
    torch_engine: Literal["per-worker", "shared"] = "per-worker"
    """With several ``workers`` and the ``torch`` backend: ``per-worker`` loads the model in every
    worker, each batching alone; ``shared`` starts one engine process (``gateway engine``) that owns the
    GPU, and the workers (decoding, batching) hand it their batches through shared memory, where one
    batcher merges them (``service.backends.engine``; metric ``gateway_engine_batch_size``). Workers
    decode straight into that memory: each worker's block holds ``max_inflight_batches x
    max_batch_size`` images for those that must be copied and ``max_queue_size`` + as many cells its
    decode threads write into (about 150 KB an image at 224 px, touched only as used; metric
    ``gateway_engine_images_total{path}``). The engine runs ``engine_inflight_batches`` batches at
    once. See docs/performance/gpu_figures.md for when each wins."""
    engine_socket: str | None = None
    """The shared engine's Unix socket (set by ``gateway serve`` for its workers; or an engine run
    on its own with ``gateway engine --socket PATH``)."""
    engine_inflight_batches: int = Field(4, ge=1, le=64)
    """Batches the shared engine runs at once (its backend threads: one batch is staged to the GPU
    while others compute). The backend alone on an H100 gave 11,017 img/s with 4 batches of 128 in
    flight against 8,857 with 1 (docs/performance/gpu_figures.md); each worker hands it up to
    ``max_inflight_batches`` batches at once."""
    engine_start_attempts: int = Field(5, ge=1, le=100)
    """Consecutive failed starts of the shared engine (it exits before serving, or within a minute
    of starting) after which ``gateway serve`` stops its workers and exits non-zero, so the container restarts;
    before that it restarts the engine with growing delays (0.5 s doubling to 30 s)."""
    engine_down_limit: float = Field(120.0, gt=0.0)
    """Seconds a worker may be without its shared engine, or with one that answers nothing (a call 5 s
    past its deadline unanswered), before ``/healthz`` fails (503), so that an orchestrator restarts
    the pod (the engine's restarts and model load must fit in it)."""
    torch_sync: Literal["blocking", "spin"] = "blocking"
    """How a ``torch`` backend thread waits for its batch on the GPU: ``blocking`` sleeps until it is
    done, leaving the core to decoding; ``spin`` busy-waits (CUDA's default with fewer processes than
    cores: a spinning core per waiting thread)."""
    decoder: Literal["opencv", "nvjpeg", "nvimagecodec"] = "opencv"
    """Image decoder: ``opencv`` on the CPU; ``nvjpeg``: JPEGs decoded, cropped and resized on the GPU
    ``torch_device`` (torchvision's ``decode_jpeg``; ``pip install '.[gpu]'``); ``nvimagecodec``: the
    same with nvImageCodec, on the GPU's hardware JPEG decoder where it has one (A100, H100; ``pip
    install nvidia-nvimgcodec-cu13``). Other formats and JPEGs the GPU refuses go to OpenCV, per image
    (counted in ``gateway_decode_fallbacks_total``)."""
    calibration_dir: Path | None = None
    """Photos like the traffic (at least 32) that calibrate the INT8 model; it is built once, on first
    start, into the models directory, and refused if its top-1 answers agree with FP32 on under 99 % of
    the held-out quarter. ``gateway models quantize --photos DIR`` builds it ahead."""
    readiness_interval: float = Field(2.0, gt=0.0, le=60.0)
    """Seconds between background readiness checks of the backend; /readyz answers from the
    latest one, so probes cost the backend nothing."""
    model: str = "efficientnet-lite0"
    """Model profile to serve: ``efficientnet-lite0`` (real ImageNet weights), ``resnet50``, or
    ``trivial`` (no real answers; almost no compute, for measuring the gateway itself)."""
    models: str = ""
    """Several models served at once, comma-separated profile names (e.g. ``efficientnet-lite0,trivial``),
    each under its own name with one version, its own backend and batcher on the settings here; the
    first is the default (``/classify``). Empty: ``model`` alone. See docs/routing.md."""
    models_file: Path | None = None
    """A TOML file naming the models served, each with its profile, versions, traffic weights, share
    and its own backend and batcher settings (see docs/routing.md); overrides ``models``. A change to
    the file takes effect without a restart: models and versions added, removed or replaced, and
    traffic weights and shares."""
    model_memory_budget: int = Field(0, ge=0)
    """Bytes the in-process models (embedded, openvino, torch) may hold at once: with a budget, the
    default model loads at start and the others on first use, and the least recently used idle one
    is unloaded when a load would exceed it; models that cannot fit together under traffic take turns
    (a version's memory: its ``memory`` in the models file, else twice its model file). 0: every
    model loaded at start, none unloaded. See docs/routing.md."""
    admin_key: SecretStr | None = None
    """Key of the models' admin routes (``POST /v1/models/{name}/load`` and ``/unload``), sent as
    ``X-Admin-Key``; unset: those routes are off (404). Not an API key: API keys classify."""
    fair_sharing: bool = True
    """With several models, share ``max_concurrent_requests``, the decode threads, the request body
    bytes and the decoder memory between them by their ``share`` (a flooded model cannot starve the
    others; see docs/routing.md). Off: first come, first served across models (for comparison)."""
    models_dir: Path = Field(default_factory=_default_models_dir)
    """Directory where built ONNX models are cached."""


class OfflineFields(_Fields):
    """The broker, images by URL, idempotent submits, webhooks and queue workers."""

    broker_url: str | None = None
    """RabbitMQ URL (e.g. ``amqp://user:pass@rabbitmq:5672/``) for offline mode; without it,
    ``mode=offline`` requests get 400 (``bad_request``, naming this setting) and ``gateway worker`` /
    ``gateway ingest`` refuse to start.
    Several comma-separated URLs name the nodes of a cluster (at most 16): each process starts on one
    at random and moves to the next when its node is lost."""
    queue_prefix: str = "gateway"
    """Prefix of every exchange and queue name, so several deployments can share a broker."""
    url_inputs: bool = True
    """Accept images by URL (JSON body ``{"images": [{"url": ...}]}``), fetched by the gateway."""
    url_allow_http: bool = False
    """Fetch plain http URLs too (https only by default)."""
    url_allowlist: str = ""
    """Comma-separated networks (CIDR) image URLs may resolve to although private, loopback or
    link-local, e.g. an internal image store's ``10.20.0.0/16``; everything else non-public is refused."""
    url_max_bytes: int = Field(16 * 1024 * 1024, gt=0)
    """Largest image fetched from a URL."""
    url_timeout: float = Field(10.0, gt=0.0)
    """Seconds for the whole fetch of one URL, redirects and a slow body included."""
    url_max_redirects: int = Field(3, ge=0, le=10)
    """Redirects followed per URL, each checked like the URL itself."""
    idempotency_ttl: float = Field(86400.0, gt=0.0)
    """Seconds an ``Idempotency-Key`` of an offline submit is remembered: a retry within it returns
    the same job ids and publishes nothing new (also the claim stream's ``max-age`` policy)."""
    idempotency_max_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    """Memory each API replica gives the idempotency keys it remembers (about 600 bytes a key, so
    ~110,000 keys by default);
    over it, the least recently used keys are forgotten before their TTL."""
    webhook_secret: SecretStr | None = None
    """Key that signs completion webhooks (``whsec_`` + base64 of 24-64 random bytes, e.g.
    ``whsec_$(openssl rand -base64 32)``); the API and the workers need the same one. Unset: a
    ``Webhook-URL`` on a submit is refused, and workers deliver none (they stay queued)."""
    webhook_allow_http: bool = False
    """Deliver webhooks to plain http URLs too (https only by default)."""
    webhook_allowlist: str = ""
    """Comma-separated networks (CIDR) webhook URLs may resolve to although private, loopback or
    link-local (e.g. an internal receiver's ``10.30.0.0/16``); everything else non-public is refused."""
    webhook_timeout: float = Field(10.0, gt=0.0)
    """Seconds a receiver has to answer one delivery attempt."""
    webhook_retry_delays: str = "1,5,30,120,600,1800"
    """Seconds before each retry of a failed delivery, the last one repeated; each is shortened by
    up to a fifth at random."""
    webhook_max_age: float = Field(86400.0, gt=0.0)
    """Seconds after a job finished during which its webhook is retried; then it is undeliverable
    (dead-lettered)."""
    webhook_concurrency: int = Field(32, ge=1, le=1024)
    """Webhook deliveries one worker makes at once."""
    publish_timeout: float = Field(5.0, gt=0.0)
    """Seconds to wait for the broker to confirm a publish before answering 503."""
    ingest_results_ttl: float = Field(7 * 86400.0, gt=0.0, le=365 * 86400.0)
    """Seconds the results queue of a ``gateway ingest`` run is kept while nothing reads it (the run
    was interrupted and not rerun): rerunning the same command within it resumes with the results
    that arrived meanwhile; after it the broker deletes the queue, and a rerun classifies the images
    still missing from its output again. Also the ``expires`` policy of ``gateway queues policies``."""
    worker_models: str = ""
    """The models a queue worker serves, comma-separated names of the models setting or file (each
    from its own queue, ``<prefix>.work.<model>``; the default model's is ``<prefix>.work``), or
    ``*`` for all of them. Empty: the default model alone."""
    worker_prefetch: int = Field(0, ge=0)
    """Unacknowledged messages a worker holds (0: max_batch_size x max_inflight_batches x 2, enough
    to keep batches full while results are being published, at most max_queue_size). Never more
    than max_queue_size: the worker's batcher must be able to hold every message it takes."""
    queue_delivery_limit: int = Field(5, ge=1, le=100)
    """Deliveries of one job to workers that died or hung holding it before it fails with
    ``delivery_limit`` and is dead-lettered (the worker checks it; ``gateway queues policies``
    gives RabbitMQ the same limit as a policy, the backstop)."""
    max_retries: int = Field(3, ge=0)
    """Times a message is retried after a backend failure before it is dead-lettered."""
    jobs_cache_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)
    """Memory each API replica gives job states for ``GET /jobs/{id}`` (results ~4-12 KB each; pending
    markers have a quarter of it of their own, so results never evict running jobs)."""
    jobs_ttl: float = Field(24 * 3600.0, gt=0.0)
    """Seconds a job state is kept after it was last written."""
    worker_metrics_port: int = Field(9101, ge=0, le=65535)
    """First port of the worker's Prometheus endpoint (0: none). A worker serves /metrics on the first
    free port of ``worker_metrics_ports`` from this one and logs which: alone in a pod or container it
    takes this one; several workers on one host take the next ones, in the order they start."""
    worker_metrics_ports: int = Field(8, ge=1, le=1024)
    """How many ports from ``worker_metrics_port`` a worker may take (1: that port only, and a second
    worker on the host does not start). A worker that finds them all in use stops with a message."""
    worker_heartbeat_file: Path | None = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "gateway-worker.heartbeat"
    )
    """File the worker's event loop touches every second; ``gateway alive`` fails when it is older
    than its ``--max-age`` (a liveness probe that a stuck loop cannot answer). Empty: no file, and
    ``gateway alive`` fails saying so."""


class LimitsFields(_Fields):
    """The bounds on requests, bodies, connections and decoding (a model's batcher is in
    ``service.settings.model``)."""

    request_timeout: float = Field(10.0, gt=0.0)
    """Seconds a /classify request may take from the end of its body (decoding, queueing,
    inference) before it gets 504; the upload has its own bound, ``body_timeout``. Also each worker
    batch's deadline."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger bodies get 413."""
    header_timeout: float = Field(10.0, gt=0.0)
    """Seconds a client has to send a request's line and headers (from the connection opening, or
    from the first byte after an answer, stray line ends included); slower ones get 408 and the
    connection is closed."""
    body_timeout: float = Field(15.0, gt=0.0)
    """Seconds a client has to send the whole request body once its headers have arrived; slower
    uploads get 408 and the connection is closed (a trickled body holds nothing longer). Also how
    long a client may leave the answers unread once the gateway's writes to it back up (over
    64 KiB waiting): then the connection is dropped."""
    max_buffered_body_bytes: int = Field(0, ge=0)
    """Body bytes all requests being handled may hold together; a chunk over it gets 429 (0:
    max_concurrent_requests x max_body_bytes). Counted in bytes received, so slow senders holding
    little do not lock out others."""
    max_connections: int = Field(1000, ge=1)
    """Open HTTP connections and tasks uvicorn allows before answering 503 (its limit_concurrency).
    Each connection holds up to ~0.3 MiB of unread body in the server's buffers, so this bounds
    that memory too."""
    max_concurrent_requests: int = Field(64, ge=1)
    """/classify requests decoding or waiting for their batch at once; beyond it the answer is 429.
    A request takes its slot once its body has arrived, so slow uploads never hold one. Memory:
    baseline + max_buffered_body_bytes + max_decode_bytes + preprocess_workers x 24 MB
    + max_queue_size x 150 KB + open connections x ~0.3 MiB, plus up to 8 MB of freed memory that
    the C allocator keeps per busy thread (``service.host.allocator``)."""
    max_image_bytes: int = Field(300_000_000, ge=1_000_000)
    """Decoder memory one image may take, reckoned from its header before decoding (width x height
    x channels x bytes per sample, twice, plus a progressive JPEG's coefficients); larger get 413.
    The default admits a 50-megapixel 8-bit RGB PNG, and JPEGs far larger (decoded at 1/8 scale)."""
    max_decode_bytes: int = Field(0, ge=0)
    """Decoder memory all images being decoded at once may take together, reckoned the same way; an
    image whose share is not free waits for it, first come first served, until its deadline (0: twice
    ``max_image_bytes``). This, not the number of decode threads, bounds decoding's memory."""
    max_images_per_request: int = Field(64, ge=1)
    """Most images in one /classify request."""
    max_json_body_bytes: int = Field(0, ge=0)
    """Largest JSON body (images by URL) accepted, checked from Content-Length and as it streams in,
    before it is parsed; larger ones get 413 (0: room for ``max_images_per_request`` URLs of the
    longest length, 2,048 characters, 2,112 bytes each with the JSON around it: 135 KB by default)."""
    preprocess_workers: int = Field(default_factory=lambda: DECODE_THREADS_PER_CPU * available_cpus(), ge=1)
    """Threads that decode and resize images (OpenCV releases the GIL); default two per CPU the
    process may use (its affinity, capped by a cgroup CPU quota, not the node's cores): a thread
    also waits for the GIL and for its turn on a core, so one per CPU leaves cores idle (see
    docs/performance/serving_path.md). Their memory is bounded by ``max_decode_bytes``, not by their
    number."""
