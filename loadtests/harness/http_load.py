"""Pieces the benchmarks share: a gateway process, an aiohttp load generator, result rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.harness.clients import gateway_async, warm_up
from loadtests.harness.resources import cpu_seconds, pinned
from service.tune.runner import free_port


@dataclass
class Row:
    mode: str
    images: int
    seconds: float
    latencies: list[float]
    mean_batch: float | None = None
    client_cpu: float | None = None
    """CPU seconds the client process used for the row."""
    server_cpu: float | None = None
    """CPU seconds the gateway process (or the queue worker) used for the row."""
    broker_cpu: float | None = None
    """CPU seconds RabbitMQ used for the row, when it took part."""

    def per_image_ms(self, seconds: float | None) -> str:
        """CPU seconds of the row as milliseconds per image, for a table cell."""
        return "n/a" if seconds is None else f"{1000 * seconds / max(self.images, 1):.2f}"

    @property
    def rate(self) -> float:
        return self.images / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def median_row(runs: list[Row]) -> Row:
    """One row from repeated runs of one mode: the run with the median throughput, whose latency,
    batch and CPU figures are reported with it (medians of each column would mix runs)."""
    ordered = sorted(runs, key=lambda r: r.rate)
    return ordered[len(ordered) // 2]


async def http_load(url: str, pid: int, photos: list[bytes], concurrency: int, images: int, mode: str) -> Row:
    """``concurrency`` clients, each posting one JPEG at a time, ``images`` requests in all (after one
    warm-up request), with the CPU the client and the gateway process ``pid`` used meanwhile."""
    await warm_up(url, photos[0], 1, 1)
    cpu0, server0 = time.process_time(), cpu_seconds(pid)
    m = await gateway_async(url, photos, concurrency, images, 0)
    client_cpu, server_cpu = time.process_time() - cpu0, cpu_seconds(pid) - server0
    if m.errors:
        print(f"warning: {m.errors} of {images} requests failed ({mode})", file=sys.stderr)
    return Row(mode, m.images, m.seconds, m.latencies, m.mean_batch, client_cpu, server_cpu)


def start_gateway(
    args: list[str],
    models_dir: Path,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    cpus: Collection[int] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """A gateway process (``gateway serve ARGS``) on a free port, returned once /readyz is 200;
    ``cwd`` runs the ``service`` package of another checkout (a baseline to compare with), ``cpus``
    pins it (and its decode threads, which it sizes by its affinity) to those CPUs."""
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_LOG_LEVEL": "warning",
        "GATEWAY_GRPC_PORT": "0",  # several gateways at once; a benchmark of gRPC gives it a port
        **(env or {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--port", str(port), *args],
        env=env,
        cwd=cwd,
        preexec_fn=pinned(cpus),
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, f"{url}/readyz", timeout, "gateway")
    return proc, url


def stop_process(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM (a graceful drain), SIGKILL after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, what: str) -> None:
    """Return once ``url`` answers 200; if ``proc`` exits first or ``timeout`` passes, kill it and
    stop the benchmark."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{what} did not become ready")
