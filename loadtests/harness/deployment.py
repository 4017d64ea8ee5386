"""The processes a benchmark starts and stops: gateway, offline worker, Triton (on this host or in
its own network namespace), and where to find RabbitMQ's process for sampling."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from loadtests.harness.http_load import start_gateway, stop_process
from loadtests.harness.network import LinkedNamespace, Shaping
from loadtests.harness.resources import pin_process, pinned
from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.settings import Settings
from service.triton.repository import TritonOptions, write_model
from service.triton.server import LocalTriton, Ports, TritonInstall, default_venv
from service.tune.runner import free_port

BROKER = os.environ.get("GATEWAY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")


@dataclass
class Triton:
    grpc_url: str
    http_url: str
    pid: int | None
    """None for a server given by URL (not sampled)."""
    network: str
    """How the gateway reaches it, in words (for the report)."""


def gateway_batching(batches: tuple[int, ...]) -> TritonOptions:
    """Triton behind the gateway: the gateway sends whole batches, so Triton's batcher does not wait
    for more (queue delay 0); it may still merge requests already queued, for the gateway and
    perf_analyzer alike. The ``python`` variant: ONNX Runtime on CPU, the backend the PyPI
    tritonserver carries."""
    return TritonOptions(
        variant="python",
        max_batch_size=max(batches),
        preferred_batch_sizes=tuple(sorted(set(batches))),
        max_queue_delay_us=0,
    )


@contextmanager
def local_triton(
    model: str, options: TritonOptions, models_dir: Path, workdir: Path, *, shaping: Shaping | None = None
) -> Iterator[Triton]:
    """A tritonserver serving ``model`` on loopback, or behind a shaped veth pair in a network
    namespace of its own when ``shaping`` is given; stopped on exit."""
    profile = get_profile(model)
    repo = workdir / f"repo-{model}-{uuid.uuid4().hex[:8]}"
    write_model(repo, profile, options, ensure_model(models_dir, profile))
    with ExitStack() as stack:
        launcher: tuple[str, ...] = ()
        address, network = "127.0.0.1", "loopback"
        if shaping is not None:
            ns = stack.enter_context(LinkedNamespace(shaping))
            address, launcher, network = ns.peer_address, ns.launcher, f"own network namespace, {ns.applied}"
        ports = Ports(free_port(), free_port(), free_port())
        server = LocalTriton(
            TritonInstall.find(default_venv()),
            repo,
            ports,
            workdir / f"{repo.name}.log",
            address=address,
            launcher=launcher,
        )
        server.start(timeout=120)
        stack.callback(server.stop)
        assert server.process is not None
        yield Triton(server.grpc_url, server.http_url, server.process.pid, network)


def gateway_args(model: str, batch: int, in_flight: int, triton: Triton | None, protocol: str) -> list[str]:
    """``gateway serve`` flags for one batch size: admission sized for the clients of the grid."""
    args = [
        "--model",
        model,
        "--max-batch-size",
        str(batch),
        "--max-images-per-request",
        str(max(64, batch)),
        "--max-concurrent-requests",
        str(max(64, in_flight)),
        "--max-queue-size",
        str(max(256, 4 * in_flight)),
        "--request-timeout",
        "60",
    ]
    if triton is not None:
        url = triton.grpc_url if protocol == "grpc" else triton.http_url
        args += ["--backend", "triton", "--triton-url", url, "--triton-protocol", protocol]
    return args


@contextmanager
def gateway(
    args: list[str],
    models_dir: Path,
    cwd: Path | None = None,
    cpus: Collection[int] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[int, str]]:
    """(pid, URL) of a ready gateway process, stopped with SIGTERM on exit; ``cwd`` runs another
    checkout's gateway, ``cpus`` pins it, ``env`` adds to its environment (``GATEWAY_GRPC_PORT``
    turns its gRPC front on; see ``start_gateway``)."""
    proc, url = start_gateway(args, models_dir, env=env, cwd=cwd, cpus=cpus)
    try:
        yield proc.pid, url
    finally:
        stop_process(proc)


@contextmanager
def worker(
    env: dict[str, str], cwd: Path | None = None, cpus: Collection[int] | None = None
) -> Iterator[tuple[subprocess.Popen[str], Settings]]:
    """A ``gateway worker`` on queues of its own (a fresh prefix), ready to consume, with the
    settings an ingest client needs to reach it; its queues are deleted afterwards. ``cwd`` runs
    another checkout's worker (a baseline to compare with), ``cpus`` pins it to those CPUs."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_LOG_LEVEL": "warning",
        **env,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "worker"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=pinned(cpus),
    )
    try:
        assert proc.stdout is not None
        while "worker ready" not in proc.stdout.readline():
            if proc.poll() is not None:
                raise SystemExit(f"gateway worker exited with status {proc.returncode}")
        yield proc, Settings.model_validate({"broker_url": BROKER, "queue_prefix": prefix})
    finally:
        stop_process(proc)
        # every queue of the run's prefix (the worker's, its model's, the results and ingest ones):
        # quorum queues left behind cost the broker CPU
        listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name"], capture_output=True, text=True)
        for queue in listed.stdout.split():
            if queue.startswith(f"{prefix}."):
                subprocess.run(["rabbitmqctl", "delete_queue", queue], capture_output=True)


def broker_pid() -> int | None:
    """RabbitMQ's Erlang VM on this host, if there is one (for resource sampling)."""
    for process in psutil.process_iter(["name"]):
        if process.info["name"] == "beam.smp":
            return int(process.pid)
    return None


@contextmanager
def pinning(count: int) -> Iterator[set[int] | None]:
    """The CPUs for the serving process (None: no pinning); this process and RabbitMQ are moved to
    the others until the end, then back onto every CPU."""
    if not count:
        yield None
        return
    everything = sorted(os.sched_getaffinity(0))
    if count >= len(everything):
        raise SystemExit(f"--serving-cpus {count}: this host has {len(everything)} CPUs; leave one for the load")
    serving, load = set(everything[-count:]), set(everything[:-count])
    broker = broker_pid()
    os.sched_setaffinity(0, load)
    if broker:
        pin_process(broker, load)
    try:
        yield serving
    finally:
        os.sched_setaffinity(0, set(everything))
        if broker:
            pin_process(broker, set(everything))
