"""The overload scenario: a gateway (fake backend, slow) admitting ``admitted`` requests at a time,
``factor`` times as many clients posting large incompressible PNGs for ``seconds``, its resident
memory sampled against the bound its settings imply; then one more request, to see it recover.
``loadtests.overload`` prints its report; ``tests/http/test_overload.py`` asserts on it.
"""

from __future__ import annotations

import asyncio
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtests.harness.http_load import start_gateway
from loadtests.harness.photos import noise_png
from loadtests.harness.resources import rss_bytes

PER_CONNECTION = 512 * 1024
"""Allowance per open connection: measured ~0.29 MiB (uvicorn keeps up to 64 KB of an unread body,
the event loop reads 256 KB at a time), plus allocator slack."""


@dataclass
class Report:
    seconds: float
    clients: int
    admitted_limit: int
    baseline_rss: int
    peak_rss: int
    bound: int
    statuses: dict[int, int] = field(default_factory=dict)
    rejection_ms: list[float] = field(default_factory=list)
    accepted_ms: list[float] = field(default_factory=list)
    recovery_ms: float = 0.0
    recovery_status: int = 0
    server_rejection_p99_ms: float = 0.0
    """Upper bound of the histogram bucket holding the gateway's own 99th-percentile 4xx time."""

    def p(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def lines(self) -> list[str]:
        mib = 1024 * 1024
        return [
            f"{self.clients} clients for {self.seconds:.0f} s against a gateway admitting {self.admitted_limit}",
            f"statuses: {dict(sorted(self.statuses.items()))}",
            f"resident memory: baseline {self.baseline_rss / mib:.0f} MiB, peak {self.peak_rss / mib:.0f} MiB, "
            f"bound {self.bound / mib:.0f} MiB (growth {(self.peak_rss - self.baseline_rss) / mib:.0f} MiB)",
            f"429 latency at the clients: p50 {self.p(self.rejection_ms, 0.5):.1f} ms, "
            f"p99 {self.p(self.rejection_ms, 0.99):.1f} ms; in the gateway: p99 <= {self.server_rejection_p99_ms:g} ms",
            f"200 latency: p50 {self.p(self.accepted_ms, 0.5):.0f} ms, p99 {self.p(self.accepted_ms, 0.99):.0f} ms, "
            f"max {max(self.accepted_ms, default=0):.0f} ms",
            f"after the load: one request -> {self.recovery_status} in {self.recovery_ms:.0f} ms",
        ]


async def drive(url: str, body: bytes, clients: int, seconds: float, report: Report) -> None:
    connector = aiohttp.TCPConnector(limit=clients)
    headers = {"content-type": "image/png"}
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client() -> None:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    async with session.post("/classify", data=body, headers=headers) as r:
                        await r.read()
                        status = r.status
                except aiohttp.ClientError:
                    status = 0  # connection reset while sending a refused body
                ms = (time.perf_counter() - t0) * 1000
                report.statuses[status] = report.statuses.get(status, 0) + 1
                if status == 429:
                    report.rejection_ms.append(ms)
                    await asyncio.sleep(random.uniform(0.05, 0.1))  # impatient clients: far less than Retry-After
                elif status == 200:
                    report.accepted_ms.append(ms)

        await asyncio.gather(*(client() for _ in range(clients)))
        t0 = time.perf_counter()
        async with session.post("/classify", data=body, headers=headers) as r:
            await r.read()
            report.recovery_status = r.status
        report.recovery_ms = (time.perf_counter() - t0) * 1000
        async with session.get("/metrics") as r:
            report.server_rejection_p99_ms = 1000 * histogram_quantile(await r.text(), 0.99)


def refusal_buckets(metrics: str) -> dict[float, float]:
    """/classify's 4xx request durations from a /metrics text: cumulative count by bucket bound,
    summed over the 4xx status codes."""
    buckets: dict[float, float] = {}
    for line in metrics.splitlines():
        if (
            line.startswith("gateway_http_request_duration_seconds_bucket{")
            and 'route="/classify"' in line
            and 'status="4' in line
        ):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def quantile_bound(buckets: dict[float, float], q: float, before: dict[float, float] | None = None) -> float:
    """Upper bound (seconds) of the bucket holding quantile q, of what was counted since ``before``."""
    counts = sorted((bound, count - (before or {}).get(bound, 0.0)) for bound, count in buckets.items())
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return float("nan")
    return next((bound for bound, count in counts if count >= q * total), float("nan"))


def histogram_quantile(metrics: str, q: float) -> float:
    """Upper bound of the bucket holding quantile q of /classify's 4xx request durations."""
    return quantile_bound(refusal_buckets(metrics), q)


def run(seconds: float = 30.0, admitted: int = 32, factor: int = 10, fake_delay: float = 0.1) -> Report:
    max_body = 1024 * 1024
    max_image_bytes = 3 * 1024 * 1024
    max_decode_bytes = 2 * max_image_bytes
    workers, queue = 8, 16
    args = [
        "--backend",
        "fake",
        "--fake-delay",
        str(fake_delay),
        "--max-batch-size",
        "4",
        "--max-queue-size",
        str(queue),
        "--max-images-per-request",
        "4",
        "--max-concurrent-requests",
        str(admitted),
        "--max-body-bytes",
        str(max_body),
        "--max-image-bytes",
        str(max_image_bytes),
        "--max-decode-bytes",
        str(max_decode_bytes),
        "--preprocess-workers",
        str(workers),
        "--request-timeout",
        "5",
    ]
    proc, url = start_gateway(args, Path(tempfile.gettempdir()) / "gateway-bench-models")
    try:
        time.sleep(1.0)
        baseline = rss_bytes(proc.pid)
        clients = admitted * factor
        bound = (
            baseline
            + admitted * max_body
            + max_decode_bytes  # shared by the decode threads, however many
            + queue * 224 * 224 * 3
            + clients * PER_CONNECTION
        )
        report = Report(seconds, clients, admitted, baseline, baseline, bound)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                report.peak_rss = max(report.peak_rss, rss_bytes(proc.pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        asyncio.run(drive(url, noise_png(), admitted * factor, seconds, report))
        stop.set()
        sampler.join()
        return report
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
