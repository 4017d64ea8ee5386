"""Command line: ``gateway [serve]``, ``gateway worker``, ``gateway models fetch|build|list|...``.

Every setting is a flag of ``serve`` (``--max-batch-size 32`` for ``GATEWAY_MAX_BATCH_SIZE``);
flags override the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from service.host import eventloop
from service.settings import Settings
from service.settings.reference import explain
from service.settings.values import setting_name

if TYPE_CHECKING:
    from service.backends.engine_supervisor import EngineSupervisor


def _add_setting_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    for name, field in Settings.model_fields.items():
        if name in skip:  # the command gives the flag a meaning of its own
            continue
        flag, variable = setting_name(name).split(" / ")
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            metavar=name.upper(),
            # argparse formats help with %: a description saying "99 % of" must not read as a format
            help=f"{field.description or ''} (env {variable})".replace("%", "%%"),
        )


def _settings(args: argparse.Namespace) -> Settings:
    """The settings of the environment and the flags, each checked, and the models they serve with
    them (profiles, backends, the models file): any problem ends the command here, before anything
    starts, with a message naming the flags and variables."""
    overrides = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        sys.exit(f"gateway: invalid settings:\n{explain(exc)}")
    from service.models.profiles import PROFILES

    if settings.model not in PROFILES:  # settings know no model table: a leaf
        known = ", ".join(PROFILES)
        sys.exit(
            f"gateway: invalid settings:\n{setting_name('model')}: unknown profile {settings.model!r}; known: {known}"
        )
    from service.serving.catalog import CatalogError, load_catalog

    try:
        load_catalog(settings)  # a bad models file fails here, by model, version and key
    except CatalogError as exc:
        sys.exit(f"gateway: invalid settings:\n{exc}")
    return settings


STARTUP_FAILURE = 3
"""Exit status of a server whose start-up failed (uvicorn's)."""

_METRIC_FILE = re.compile(r"(counter|gauge_[a-z]+|histogram|summary)_\d+\.db")
"""prometheus_client's per-process files in multiprocess mode."""


def _prepare_multiprocess(args: argparse.Namespace) -> None:
    """Before uvicorn spawns its workers: hand them the CLI's settings through the environment, and
    give prometheus_client an empty directory for its per-process files (read at import time)."""
    import tempfile

    from service.http.quotas import STATE_FILE as QUOTA_STATE

    for name in Settings.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            os.environ[f"GATEWAY_{name.upper()}"] = str(value)
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        directory = tempfile.mkdtemp(prefix="gateway-metrics-")
    else:  # the operator's folder: remove stale metric files (they would be summed in), nothing else
        os.makedirs(directory, exist_ok=True)
        for entry in Path(directory).iterdir():
            if entry.is_file() and (_METRIC_FILE.fullmatch(entry.name) or entry.name == QUOTA_STATE):
                entry.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def _logging(settings: Settings) -> dict[str, Any]:
    from service.logs import configure_logging

    return configure_logging(settings.log_level, settings.log_format, settings.log_repeat_interval)


@contextlib.contextmanager
def _shared_engine(settings: Settings) -> Iterator[EngineSupervisor | None]:
    """With ``GATEWAY_TORCH_ENGINE=shared`` (and the torch backend), the engine process that owns
    the GPU, for the workers spawned inside the block, kept running (restarted when it dies);
    stopped after them. Yields its supervisor, whose ``gave_up`` says the engine could not be kept up."""
    if settings.backend != "torch" or settings.torch_engine != "shared" or settings.engine_socket:
        yield None  # per-worker models, or an engine the operator runs (GATEWAY_ENGINE_SOCKET)
        return
    import signal
    import tempfile

    from service.backends.engine_supervisor import EngineSupervisor

    socket_path = os.path.join(tempfile.mkdtemp(prefix="gateway-engine-"), "engine.sock")
    os.environ["GATEWAY_ENGINE_SOCKET"] = socket_path
    supervisor = EngineSupervisor(
        [sys.executable, "-m", "service", "engine", "--socket", socket_path],
        attempts=settings.engine_start_attempts,
        on_give_up=lambda: os.kill(os.getpid(), signal.SIGTERM),  # uvicorn stops the workers, then we exit
    )
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        with contextlib.suppress(OSError):
            os.unlink(socket_path)
            os.rmdir(os.path.dirname(socket_path))


def _engine(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from service.backends.engine_server import run_engine

    _logging(_settings(args))

    def ready() -> None:  # tell the supervisor (gateway serve) that the engine listens
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"1")
            os.close(args.ready_fd)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if args.parent_fd is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
        else:
            # Started by gateway serve: it stops when serve closes the pipe (or dies), after serve's
            # workers have drained. A SIGTERM or SIGINT sent to every process of the gateway at once
            # (systemd's stop, a Ctrl-C) is serve's to act on, not the engine's: stopping then
            # would fail the requests the workers are still draining.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)
            loop.add_reader(args.parent_fd, stop.set)  # readable at end-of-file
        await run_engine(args.socket, stop, ready)

    eventloop.run(main())
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from service.http.listeners import ListenError, addresses, listen
    from service.http.protocol import http_protocol

    settings = _settings(args)
    common: dict[str, Any] = {
        "log_level": settings.log_level,
        "log_config": _logging(settings),
        "timeout_graceful_shutdown": int(settings.request_timeout) + 5,
        "limit_concurrency": settings.max_connections,
        "http": http_protocol(settings.header_timeout, settings.body_timeout, settings.max_body_bytes),
        "access_log": settings.access_log,
        # X-Forwarded-For is read only to log the client behind a proxy: without the access log,
        # nothing reads the client address, and the header walk is a layer on every request.
        "proxy_headers": settings.access_log,
    }
    try:  # before any model loads: a port in use ends the start here, and "ready" means listening
        sockets = listen(settings.host, settings.port)
    except ListenError as exc:
        sys.exit(f"gateway: {exc} ({setting_name('host')}, {setting_name('port')})")
    logging.getLogger("service.cli").info("listening on %s; answering once the models are loaded", addresses(sockets))
    if settings.workers > 1:
        _prepare_multiprocess(args)
        config = uvicorn.Config(
            "service.http.app:app_from_environment", factory=True, workers=settings.workers, **common
        )
        with _shared_engine(settings) as engine:
            Multiprocess(config, sockets=sockets).run()
        if engine is not None and engine.gave_up:
            sys.exit(f"gateway: the shared engine failed {settings.engine_start_attempts} starts in a row")
        return 0
    from service.http.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(settings), **common))
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a shutdown, not an error
        server.run(sockets=sockets)
    return 0 if server.started else STARTUP_FAILURE


def _models_build(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES, get_profile
    from service.models.store import ensure_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    names = list(PROFILES) if args.all else [settings.model]
    for name in names:
        path = ensure_model(settings.models_dir, get_profile(name), weights_for(settings, name), force=args.force)
        print(path)
    return 0


def _models_triton_repo(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES, get_profile
    from service.models.store import ensure_model
    from service.triton.repository import TritonOptions, write_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    options = TritonOptions(
        variant=args.variant,
        max_batch_size=args.triton_max_batch_size,
        preferred_batch_sizes=tuple(int(n) for n in args.triton_preferred.split(",")),
        max_queue_delay_us=args.triton_queue_delay_us,
        max_queue_size=args.triton_max_queue_size,
        instances=args.triton_instances,
        kind={"gpu": "KIND_GPU", "cpu": "KIND_CPU", None: None}[args.triton_kind],
        intra_op_threads=args.triton_intra_op_threads,
        bf16=not args.triton_no_bf16,
        tensorrt_accelerator=not args.triton_no_tensorrt,
        engine_cache=args.triton_engine_cache,
    )
    for name in list(PROFILES) if args.all else [settings.model]:
        profile = get_profile(name)
        onnx = None
        if not args.config_only:
            onnx = ensure_model(settings.models_dir, profile, weights_for(settings, name))
        print(write_model(args.out, profile, options, onnx))
    return 0


def _models_quantize(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import get_profile
    from service.models.quantize import QuantizationRefused, ensure_int8
    from service.models.store import ensure_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    profile = get_profile(settings.model)
    onnx = ensure_model(settings.models_dir, profile, weights_for(settings, profile.name))
    try:
        path = ensure_int8(settings.models_dir, profile, onnx, args.photos, force=args.force)
    except QuantizationRefused as exc:
        print(f"gateway models quantize: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(path.with_name("build.json").read_text())
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from service.models.checkpoints import weights_for
    from service.models.profiles import PROFILES
    from service.models.store import model_path, recorded_sha256

    settings = _settings(args)
    for profile in PROFILES.values():
        path = model_path(settings.models_dir, profile)
        state = (recorded_sha256(path) or "not built")[:12]
        weights = weights_for(settings, profile.name)
        source = weights.name if weights else "RANDOM weights" if profile.random_without_weights else "packaged weights"
        print(f"{profile.name:20} v{profile.version}  {profile.image_size}px  {state:12}  {source:20}  {path}")
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    from service.models.checkpoints import CHECKPOINTS, FetchFailed, fetch
    from service.models.profiles import get_profile
    from service.models.store import ensure_model
    from service.triton.repository import TritonOptions, write_model

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    name = args.model or settings.model
    if name not in CHECKPOINTS:
        known = ", ".join(CHECKPOINTS)
        sys.exit(f"gateway models fetch: no published checkpoint is pinned for {name!r}; known: {known}")
    shown = [-1]

    def progress(received: int, total: int | None) -> None:
        step = received * 10 // total if total else received // (10 * 1024 * 1024)
        if step != shown[0]:
            shown[0] = step
            of = f" of {total / 1e6:.1f}" if total else ""
            print(f"  {received / 1e6:.1f}{of} MB", file=sys.stderr, flush=True)

    checkpoint = CHECKPOINTS[name]
    try:
        path = fetch(checkpoint, settings.models_dir, url=args.url, sha256=args.sha256, progress=progress)
    except FetchFailed as exc:
        sys.exit(f"gateway models fetch: {exc}")
    print(f"checkpoint: {path} ({checkpoint.description if not args.sha256 else 'SHA-256 ' + args.sha256})")
    profile = get_profile(name)
    onnx = ensure_model(settings.models_dir, profile, path)
    print(f"onnx: {onnx}")
    if args.triton_repo is not None:
        print(f"triton: {write_model(args.triton_repo, profile, TritonOptions(variant=args.variant), onnx)}")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from service.jobs.worker import run_worker
    from service.serving.catalog import CatalogError

    settings = _settings(args)
    _logging(settings)
    try:
        eventloop.run(run_worker(settings))
    except CatalogError as exc:
        sys.exit(f"gateway worker: invalid settings:\n{exc}")
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from service.jobs.ingest import run_ingest

    if args.connect_timeout < 0:
        sys.exit("gateway ingest: --connect-timeout must be 0 (wait for ever) or more seconds")
    settings = _settings(args)
    _logging(settings)
    return eventloop.run(
        run_ingest(
            settings,
            args.paths,
            args.out,
            top_k=args.top_k,
            max_outstanding=args.max_outstanding,
            resend_after=args.resend_after,
            model=args.target_model,
            version=args.model_version,
            connect_timeout=args.connect_timeout or None,
        )
    )


def _queue_policies(args: argparse.Namespace) -> int:
    import asyncio

    from service.jobs.policies import apply, gateway_policies, shell_lines
    from service.jobs.topology import Names

    settings = _settings(args)
    policies = gateway_policies(
        Names(settings.queue_prefix),
        settings.queue_delivery_limit,
        idempotency_ttl=settings.idempotency_ttl,
        ingest_ttl=settings.ingest_results_ttl,
    )
    if args.apply is None:
        print(shell_lines(policies, args.vhost))
        return 0
    asyncio.run(apply(args.apply, policies, args.vhost))
    print(f"applied {len(policies)} policies: {', '.join(p.name for p in policies)}")
    return 0


def _alive(args: argparse.Namespace) -> int:
    """Liveness probe of a worker: 0 when its event loop touched the heartbeat file recently."""
    from service.jobs.worker import heartbeat_age

    path = args.file or _settings(args).worker_heartbeat_file
    if path is None:
        sys.exit(
            "gateway alive: no heartbeat file to check: GATEWAY_WORKER_HEARTBEAT_FILE is empty and no --file was "
            "given; set either to the file the worker touches (the worker's default: "
            "$TMPDIR/gateway-worker.heartbeat)"
        )
    if path.is_dir():  # other processes change a directory's time: it proves nothing about the loop
        sys.exit(f"gateway alive: {path} is a directory, not the worker's heartbeat file")
    age = heartbeat_age(path)
    if age == float("inf"):
        print(
            f"not alive: {path} does not exist: the worker has not started, or it writes another file "
            "(GATEWAY_WORKER_HEARTBEAT_FILE and TMPDIR must be the worker's)",
            file=sys.stderr,
        )
        return 1
    if age > args.max_age:
        print(f"not alive: {path} last touched {age:.0f} s ago (limit {args.max_age:g} s)", file=sys.stderr)
        return 1
    return 0


def _tune(args: argparse.Namespace) -> int:
    from service.tune.command import run

    return run(args, _settings(args))


def _settings_reference(args: argparse.Namespace) -> int:
    from service.settings.reference import reference

    print(reference(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="Async inference gateway.")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run the HTTP gateway (the default command)")
    _add_setting_flags(serve)
    serve.set_defaults(func=_serve)
    worker = commands.add_parser("worker", help="consume queued images from RabbitMQ and publish results")
    _add_setting_flags(worker)
    worker.set_defaults(func=_worker)
    engine = commands.add_parser(
        "engine", help="the process that owns the GPU for serve's workers (GATEWAY_TORCH_ENGINE=shared)"
    )
    _add_setting_flags(engine)
    engine.add_argument("--socket", required=True, help="Unix socket the workers connect to")
    engine.add_argument(
        "--ready-fd", type=int, default=None, help="a pipe's fd to write one byte to once listening (gateway serve's)"
    )
    engine.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help=(
            "a pipe's fd whose end-of-file means the process that started the engine is gone or stopping:"
            " the engine stops (with it, the engine ignores SIGTERM and SIGINT)"
        ),
    )
    engine.set_defaults(func=_engine)
    queues = commands.add_parser("queues", help="RabbitMQ set-up for offline mode")
    queue_commands = queues.add_subparsers(dest="queues_command", required=True)
    policies = queue_commands.add_parser(
        "policies", help="print the queue policies as rabbitmqctl commands, or apply them (--apply)"
    )
    _add_setting_flags(policies)
    policies.add_argument("--apply", metavar="URL", help="management API, e.g. http://user:pass@rabbitmq:15672")
    policies.add_argument("--vhost", default="/", help="virtual host (default /)")
    policies.set_defaults(func=_queue_policies)
    alive = commands.add_parser("alive", help="worker liveness probe: exit 1 when its event loop is stuck")
    _add_setting_flags(alive)
    alive.add_argument("--file", type=Path, default=None, help="heartbeat file (default: the worker's setting)")
    alive.add_argument("--max-age", type=float, default=30.0, help="seconds without a heartbeat that mean stuck")
    alive.set_defaults(func=_alive)
    reference = commands.add_parser("settings", help="print the settings reference (docs/settings.md's table)")
    reference.set_defaults(func=_settings_reference)
    ingest = commands.add_parser("ingest", help="classify a folder of photos through RabbitMQ into JSON lines")
    _add_setting_flags(ingest, skip=frozenset({"model"}))  # --model: the model the jobs are for
    ingest.add_argument("paths", nargs="+", type=Path, help="image files or folders (searched recursively)")
    ingest.add_argument("--out", type=Path, required=True, help="results file (JSON lines); re-runs resume it")
    ingest.add_argument("--top-k", type=int, default=5, choices=range(1, 21), metavar="1-20")
    ingest.add_argument("--max-outstanding", type=int, default=256, help="publishes awaiting a broker confirm")
    ingest.add_argument(
        "--resend-after",
        type=float,
        default=120.0,
        help="seconds without any new result before unfinished images are published again",
    )
    ingest.add_argument(
        "--model",
        dest="target_model",
        metavar="NAME",
        help="the model the jobs are for, one the models setting or file names (default: the default model; "
        "its queue is the one its workers take: see docs/routing.md)",
    )
    ingest.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the first connection to the broker before giving up with exit status 69 "
        "(0: for ever); Ctrl-C or SIGTERM stops a run with exit status 130, and the same command resumes it",
    )
    ingest.add_argument(
        "--model-version",
        metavar="VERSION",
        help="the version of --model the jobs are for (default: the workers pick one by the traffic weights)",
    )
    ingest.set_defaults(func=_ingest)
    tune = commands.add_parser(
        "tune",
        help="search the batching settings for the most throughput within a p99 target; write them as an env file",
    )
    _add_setting_flags(tune)
    from service.tune.command import add_arguments

    add_arguments(tune)
    tune.set_defaults(func=_tune)
    models = commands.add_parser("models", help="fetch checkpoints, build or list the cached ONNX models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    fetch = model_commands.add_parser(
        "fetch",
        help="download a model's published checkpoint (URL and SHA-256 pinned), verify it, and build the model "
        "from it; it becomes the model's default weights",
    )
    _add_setting_flags(fetch)
    fetch.add_argument("model", nargs="?", default=None, help="e.g. resnet50 (default: the configured model)")
    fetch.add_argument("--url", default=None, help="a mirror of the checkpoint (the pinned SHA-256 is still checked)")
    fetch.add_argument("--sha256", default=None, help="a checkpoint of one's own: the SHA-256 it must have")
    fetch.add_argument("--triton-repo", type=Path, default=None, help="also write a Triton repository here")
    fetch.add_argument("--variant", choices=["tensorrt", "onnxruntime", "openvino", "python"], default="onnxruntime")
    fetch.set_defaults(func=_models_fetch)
    build = model_commands.add_parser("build", help="build the configured model's ONNX file (or --all)")
    _add_setting_flags(build)
    build.add_argument("--all", action="store_true", help="build every known model")
    build.add_argument("--force", action="store_true", help="rebuild even when the cached file is current")
    build.set_defaults(func=_models_build)
    repo = model_commands.add_parser("triton-repo", help="write a Triton model repository for the model (or --all)")
    _add_setting_flags(repo)
    repo.add_argument("--out", type=Path, required=True, help="repository folder to write into")
    repo.add_argument(
        "--variant",
        choices=["tensorrt", "onnxruntime", "openvino", "python"],
        default="python",
        help="tensorrt (GPU; plan built by build_plan.sh), onnxruntime, openvino (CPU hosts), or python (CPU hosts, "
        "and the tritonserver of PyPI's pytriton wheel)",
    )
    repo.add_argument("--all", action="store_true", help="every known model")
    repo.add_argument("--config-only", action="store_true", help="write configuration files, not the ONNX file")
    repo.add_argument("--triton-max-batch-size", type=int, default=64)
    repo.add_argument("--triton-preferred", default="8,16,32", help="preferred batch sizes, comma-separated")
    repo.add_argument("--triton-queue-delay-us", type=int, default=2000)
    repo.add_argument(
        "--triton-max-queue-size",
        type=int,
        default=0,
        help="Triton's per-model queue bound (0: none; see deploy/triton/README.md on Triton 2.51's queue policy)",
    )
    repo.add_argument("--triton-instances", type=int, default=1, help="model instances (per GPU)")
    repo.add_argument("--triton-kind", choices=["gpu", "cpu"], default=None)
    repo.add_argument(
        "--triton-intra-op-threads", type=int, default=0, help="python and openvino variants: runtime threads"
    )
    repo.add_argument("--triton-no-bf16", action="store_true", help="openvino variant: fp32 kernels only")
    repo.add_argument(
        "--triton-no-tensorrt",
        action="store_true",
        help="onnxruntime variant on GPU: CUDA only, without the TensorRT accelerator (on by default, FP16)",
    )
    repo.add_argument(
        "--triton-engine-cache",
        default="/engine-cache",
        help="onnxruntime variant on GPU: where Triton keeps TensorRT engines (mount a volume there)",
    )
    repo.set_defaults(func=_models_triton_repo)
    quantize = model_commands.add_parser(
        "quantize", help="build the model's INT8 version for the openvino backend, calibrated on photos"
    )
    _add_setting_flags(quantize)
    quantize.add_argument(
        "--photos",
        type=Path,
        required=True,
        help="folder of photos like the traffic (at least 32; searched recursively)",
    )
    quantize.add_argument("--force", action="store_true", help="quantize again even when the cached model is current")
    quantize.set_defaults(func=_models_quantize)
    listing = model_commands.add_parser("list", help="list the known models and their cache state")
    _add_setting_flags(listing)
    listing.set_defaults(func=_models_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
