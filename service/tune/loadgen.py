"""A closed-loop HTTP load on ``POST /classify``: N clients, each sending its next image as soon as
the previous answer arrived. What ``gateway tune`` measures candidates with (the benchmarks in
``loadtests/`` have their own clients, with the CPU accounting a study needs).

A closed loop is how Triton's Model Analyzer and perf_analyzer sweep a configuration: raising the
number of clients raises the load until latency, not throughput, grows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass
class Load:
    """One closed-loop run at ``concurrency`` clients."""

    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    """Seconds, of the 200 answers."""
    failures: int = 0
    """Answers other than 200, and requests that got no answer."""
    client_cpu: float = 0.0
    """CPU seconds this process spent generating the load."""

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    @property
    def failure_share(self) -> float:
        return self.failures / max(len(self.latencies) + self.failures, 1)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("inf")


async def closed_loop(
    url: str,
    images: Sequence[bytes],
    concurrency: int,
    seconds: float,
    warmup: float = 0.5,
    content_type: str = "image/jpeg",
) -> Load:
    """``concurrency`` clients posting ``images`` in turn to ``{url}/classify`` for ``warmup`` +
    ``seconds``; only requests sent after the warm-up are recorded."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    record_from = start + warmup
    end = record_from + seconds
    load = Load(concurrency, seconds)
    headers = {"content-type": content_type}
    cpu0 = time.process_time()
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(first: int) -> None:
            index = first
            while (sent := loop.time()) < end:
                try:
                    async with session.post(f"{url}/classify", data=images[index % len(images)], headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                index += concurrency
                if sent < record_from:
                    continue
                if ok:
                    load.latencies.append(loop.time() - sent)
                else:
                    load.failures += 1

        await asyncio.gather(*(client(n) for n in range(concurrency)))
    load.client_cpu = time.process_time() - cpu0
    return load
