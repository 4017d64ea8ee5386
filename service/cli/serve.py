"""``gateway serve`` (the HTTP gateway, one process or several) and ``gateway engine`` (the process
that owns the GPU for serve's workers)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli.common import STARTUP_FAILURE, load_settings, logging_config
from service.host import eventloop
from service.settings import Settings
from service.settings.values import setting_name

if TYPE_CHECKING:
    from service.backends.engine_supervisor import EngineSupervisor

_METRIC_FILE = re.compile(r"(counter|gauge_[a-z]+|histogram|summary)_\d+\.db")
"""prometheus_client's per-process files in multiprocess mode."""


def prepare_multiprocess(args: argparse.Namespace) -> None:
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


@contextlib.contextmanager
def shared_engine(settings: Settings) -> Iterator[EngineSupervisor | None]:
    """With ``GATEWAY_TORCH_ENGINE=shared`` (and the torch backend), the engine process that owns
    the GPU, for the workers spawned inside the block, kept running (restarted when it dies);
    stopped after them. Yields its supervisor, whose ``gave_up`` says the engine could not be kept up."""
    from service.backends.capabilities import shares_engine

    if not shares_engine(settings) or settings.engine_socket:
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


def engine(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from service.backends.engine_server import run_engine

    settings = load_settings(args, serves=True)
    logging_config(settings)

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
        await run_engine(settings, args.socket, stop, ready)

    eventloop.run(main())
    return 0


def serve(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from service.http.listeners import ListenError, addresses, listen, probe
    from service.http.refusing import http_protocol

    settings = load_settings(args, serves=True)
    common: dict[str, Any] = {
        "log_level": settings.log_level,
        "log_config": logging_config(settings),
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
    if settings.grpc_port:  # found now, not after the models load; the workers bind it themselves
        try:
            probe(settings.host, settings.grpc_port)
        except ListenError as exc:
            sys.exit(f"gateway: {exc} for gRPC ({setting_name('host')}, {setting_name('grpc_port')})")
    logging.getLogger("service.cli").info("listening on %s; answering once the models are loaded", addresses(sockets))
    if settings.workers > 1:
        prepare_multiprocess(args)
        config = uvicorn.Config("service.server:app_from_environment", factory=True, workers=settings.workers, **common)
        with shared_engine(settings) as engine:
            Multiprocess(config, sockets=sockets).run()
        if engine is not None and engine.gave_up:
            sys.exit(f"gateway: the shared engine failed {settings.engine_start_attempts} starts in a row")
        return 0
    from service.server import create_server

    server = uvicorn.Server(uvicorn.Config(create_server(settings), **common))
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a shutdown, not an error
        server.run(sockets=sockets)
    return 0 if server.started else STARTUP_FAILURE
