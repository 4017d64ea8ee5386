"""Open-loop (Poisson) load: requests at exponential gaps whether or not earlier ones were
answered, as real traffic arrives; a closed loop of N clients would slow down with the server and
hide the queueing a figure is about. Each request on its own task, no client-side queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import cv2
import numpy as np
from skimage import data as skdata


@dataclass
class Run:
    offered: float
    seconds: float
    latencies: list[float] = field(default_factory=list)
    """Seconds, of the answers with status 200."""
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")

    def share(self, status: int) -> float:
        return self.statuses.get(status, 0) / max(sum(self.statuses.values()), 1)

    @property
    def errors(self) -> int:
        """Answers other than 200."""
        return sum(count for status, count in self.statuses.items() if status != 200)


def jpeg_224() -> bytes:
    rgb = cv2.resize(skdata.chelsea(), (224, 224), interpolation=cv2.INTER_AREA)  # type: ignore[no-untyped-call]
    return bytes(cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())


async def open_loop(
    url: str, body: bytes, rate: float, seconds: float, seed: int, path: str = "/classify", start_in: float = 0.0
) -> Run:
    """Requests to ``path`` at exponential gaps (mean 1/rate) for ``seconds``, after ``start_in``."""
    rng = np.random.default_rng(seed)
    run = Run(rate, seconds)
    loop = asyncio.get_running_loop()
    headers = {"content-type": "image/jpeg"}
    connector = aiohttp.TCPConnector(limit=0)  # no client-side queue: the gateway sees every arrival
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one() -> None:
            start = loop.time()
            try:
                async with session.post(f"{url}{path}", data=body, headers=headers) as response:
                    await response.read()
                    status = response.status
            except aiohttp.ClientError:
                status = 0
            run.statuses[status] = run.statuses.get(status, 0) + 1
            if status == 200:
                run.latencies.append(loop.time() - start)

        tasks = []
        next_at = loop.time() + start_in
        end = next_at + seconds
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            tasks.append(asyncio.create_task(one()))
            next_at += float(rng.exponential(1 / rate))
        await asyncio.gather(*tasks)
    return run
