"""Pieces the benchmarks share: a gateway process, an aiohttp load generator, result rows."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from loadtests.resources import cpu_seconds


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
    """CPU seconds the gateway process used for the row."""

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


def _batch_totals(metrics: str) -> tuple[float, float]:
    def value(name: str) -> float:
        match = re.search(rf"^{name} ([0-9.e+]+)$", metrics, re.M)
        return float(match.group(1)) if match else 0.0

    return value("gateway_batch_size_sum"), value("gateway_batch_size_count")


async def http_load(url: str, pid: int, photos: list[bytes], concurrency: int, images: int, mode: str) -> Row:
    """``concurrency`` clients, each posting one JPEG at a time, ``images`` requests in all.

    The client is aiohttp: on this kind of machine httpx's async client costs 10-20x more CPU per
    request, and client and gateway share the cores."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "image/jpeg"}
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        async with client.post("/classify", data=photos[0], headers=headers) as warm:
            await warm.read()
        async with client.get("/metrics") as r:
            before = _batch_totals(await r.text())
        latencies: list[float] = []
        counter = iter(range(images))
        errors = 0

        async def worker() -> None:
            nonlocal errors
            for i in counter:
                t0 = time.perf_counter()
                async with client.post("/classify", data=photos[i % len(photos)], headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
                latencies.append(time.perf_counter() - t0)

        cpu0, server0, start = time.process_time(), cpu_seconds(pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        client_cpu, server_cpu = time.process_time() - cpu0, cpu_seconds(pid) - server0
        async with client.get("/metrics") as r:
            after = _batch_totals(await r.text())
    if errors:
        print(f"warning: {errors} of {images} requests failed ({mode})", file=sys.stderr)
    batches = after[1] - before[1]
    mean_batch = (after[0] - before[0]) / batches if batches else None
    return Row(mode, images - errors, seconds, latencies, mean_batch, client_cpu, server_cpu)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gateway(
    args: list[str], models_dir: Path, timeout: float = 180, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A gateway process (``gateway serve ARGS``) on a free port, returned once /readyz is 200."""
    port = free_port()
    env = {**os.environ, "GATEWAY_MODELS_DIR": str(models_dir), "GATEWAY_LOG_LEVEL": "warning", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port), *args], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gateway exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("gateway did not become ready")
