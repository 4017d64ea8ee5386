"""The clients of the experiment grid (see ``loadtests.harness.grid``), each measuring one run.

* :func:`gateway_sync` / :func:`gateway_async`: HTTP clients of the gateway (aiohttp: httpx's async
  client costs 10-20x more CPU per request, and client and gateway share the cores here);
* :func:`direct`: the embedded model called in this process on decoded tensors;
* :func:`offline`: the ingest client -> RabbitMQ -> a running ``gateway worker``;
* perf_analyzer lives in ``loadtests.harness.perf_analyzer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.backends.embedded import EmbeddedBackend
from service.jobs.ingest import run_ingest
from service.settings import Settings


class Photos(Protocol):
    """Encoded photos by index: a list of bytes (in memory) or :class:`FilePhotos` (read on use)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> bytes: ...


class FilePhotos:
    """Photos the client reads from disk each time it sends one, as the study's (docs/study.md) application did."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        return self.paths[index].read_bytes()


@dataclass
class Measurement:
    images: int
    """Images answered correctly."""
    seconds: float
    latencies: list[float]
    """Seconds per request (per batch for direct; empty for offline)."""
    errors: int = 0
    mean_batch: float | None = None
    p50_override_ms: float | None = None
    p99_override_ms: float | None = None

    @property
    def rate(self) -> float:
        return self.images / self.seconds

    def percentile_ms(self, q: float) -> float | None:
        override = self.p50_override_ms if q == 0.5 else self.p99_override_ms if q == 0.99 else None
        if override is not None:
            return override
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _batch_totals(session: aiohttp.ClientSession, histogram: str = "gateway_batch_size") -> dict[str, float]:
    """The batch-size histogram's ``sum`` and ``count`` from the gateway's /metrics (``histogram``:
    ``gateway_engine_batch_size`` for the shared engine's batches)."""
    async with session.get("/metrics") as r:
        if r.status != 200:  # a gateway given by URL may key its metrics
            return {}
        text = await r.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == histogram:
            for sample in family.samples:
                kind = sample.name.removeprefix(f"{histogram}_")
                if kind in ("sum", "count"):
                    totals[kind] = totals.get(kind, 0.0) + sample.value
    return totals


def _mean_batch(before: dict[str, float], after: dict[str, float]) -> float | None:
    batches = after.get("count", 0.0) - before.get("count", 0.0)
    return (after.get("sum", 0.0) - before.get("sum", 0.0)) / batches if batches > 0 else None


def session(url: str, connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=connections)
    return aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=300))


def _form(photos: list[bytes]) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for i, photo in enumerate(photos):
        form.add_field("file", photo, filename=f"{i}.jpg", content_type="image/jpeg")
    return form


async def _post(client: aiohttp.ClientSession, photos: list[bytes]) -> tuple[int, int]:
    """(images classified, images failed) for one /classify request: a raw JPEG body for one
    photo, multipart for several."""
    expected = len(photos)
    data, headers = (photos[0], {"content-type": "image/jpeg"}) if expected == 1 else (_form(photos), None)
    async with client.post("/classify", data=data, headers=headers) as r:
        body = await r.read()
        if r.status != 200:
            return 0, expected
        results = json.loads(body).get("results", [])
        return len(results), expected - len(results)


async def gateway_sync(url: str, photos: Photos, batch: int, images: int, offset: int) -> Measurement:
    """One request at a time, each a multipart POST of ``batch`` photos: the client batches and waits."""
    async with session(url, 1) as client:
        before = await _batch_totals(client)
        latencies: list[float] = []
        done = errors = 0
        start = time.perf_counter()
        for first in range(offset, offset + images, batch):
            t0 = time.perf_counter()
            ok, failed = await _post(client, [photos[i % len(photos)] for i in range(first, first + batch)])
            latencies.append(time.perf_counter() - t0)
            done, errors = done + ok, errors + failed
        seconds = time.perf_counter() - start
        after = await _batch_totals(client)
    return Measurement(done, seconds, latencies, errors, _mean_batch(before, after))


async def gateway_async(url: str, photos: Photos, in_flight: int, images: int, offset: int) -> Measurement:
    """``in_flight`` clients each posting one photo at a time: the gateway forms the batches."""
    async with session(url, in_flight) as client:
        before = await _batch_totals(client)
        latencies: list[float] = []
        counter = iter(range(offset, offset + images))
        done = errors = 0

        async def one_client() -> None:
            nonlocal done, errors
            for i in counter:
                t0 = time.perf_counter()
                ok, failed = await _post(client, [photos[i % len(photos)]])
                latencies.append(time.perf_counter() - t0)
                done, errors = done + ok, errors + failed

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(in_flight)))
        seconds = time.perf_counter() - start
        after = await _batch_totals(client)
    return Measurement(done, seconds, latencies, errors, _mean_batch(before, after))


async def warm_up(url: str, photo: bytes, batch: int, in_flight: int) -> None:
    """Requests of 1, 2, 4 ... ``batch`` photos, then two rounds of ``in_flight`` at once, so that
    first-call costs (a model's first runs at new batch shapes, connection set-up) stay out of the runs."""
    sizes = sorted({min(2**i, batch) for i in range(batch.bit_length() + 1)})
    async with session(url, in_flight) as client:
        for size in sizes:
            await _post(client, [photo] * size)
        for _ in range(2):
            await asyncio.gather(*(_post(client, [photo]) for _ in range(in_flight)))


async def direct(backend: EmbeddedBackend, tensors: list[np.ndarray], batch: int, images: int) -> Measurement:
    """Batches of ready tensors straight into the embedded model: the study's (docs/study.md) "(1) without files"."""
    latencies: list[float] = []
    done = 0
    start = time.perf_counter()
    while done < images:
        t0 = time.perf_counter()
        await backend.infer(np.stack([tensors[(done + i) % len(tensors)] for i in range(batch)]))
        latencies.append(time.perf_counter() - t0)
        done += batch
    return Measurement(done, time.perf_counter() - start, latencies, mean_batch=float(batch))


async def offline(settings: Settings, files: list[Path], workdir: Path) -> Measurement:
    """Publish ``files`` through RabbitMQ to the running worker and wait for every result, timed from
    the first publish to the last result written. The ingest client runs in this process (its start-up
    is not counted); its progress lines are kept off the terminal."""
    out = workdir / f"results-{time.monotonic_ns()}.jsonl"
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        await run_ingest(settings, files, out)
    seconds = time.perf_counter() - start
    results = [json.loads(line) for line in out.read_text().splitlines()]
    failed = sum(r["status"] != "done" for r in results)
    return Measurement(len(results) - failed, seconds, [], errors=failed + len(files) - len(results))
