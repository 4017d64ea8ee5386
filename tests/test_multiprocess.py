"""Several uvicorn workers: /metrics counts every worker's requests once, whichever answers it."""

from __future__ import annotations

import asyncio
import re
import signal
import struct
import tempfile
from pathlib import Path

import aiohttp
import pytest

from loadtests.http_load import start_gateway
from tests.conftest import png_bytes, solid_image


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert match, f"{series} not in /metrics"
    return float(match.group(1))


@pytest.mark.slow
async def test_two_workers_are_counted_once_each(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "prometheus-multiproc"
    proc, url = start_gateway(
        ["--backend", "fake", "--workers", "2"],
        Path(tempfile.gettempdir()) / "gateway-bench-models",
        env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
    )
    try:
        # a new connection per request, so the kernel spreads them over both workers' accept()
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def classify(v: int) -> int:
                async with session.post(
                    "/classify", data=png_bytes(solid_image(v, 16)), headers={"content-type": "image/png"}
                ) as r:
                    return r.status

            assert await asyncio.gather(*(classify(v) for v in range(40))) == [200] * 40
            scrapes = []
            for _ in range(6):
                async with session.get("/metrics") as r:
                    scrapes.append(await r.text())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    for text in scrapes:  # whichever worker answered, the totals are over all workers
        assert value(text, 'gateway_images_classified_total{mode="online"}') == 40
        assert value(text, 'gateway_http_requests_total{method="POST",route="/classify",status="200"}') == 40
        assert value(text, "gateway_batch_size_sum") == 40
    pids = {m.group(1) for f in metrics_dir.iterdir() if (m := re.match(r"counter_(\d+)\.db", f.name))}
    assert len(pids) >= 2, f"only {pids} served: the test did not exercise several workers"


@pytest.mark.slow
async def test_a_keys_rate_holds_over_all_workers(tmp_path: Path) -> None:
    """Workers share one quota table: a key with a burst of 10 and no refill to speak of gets 10
    images through in total, not 10 per worker. A table left by an earlier run (here: a slot
    saying the key has 99 requests in progress) is cleared at start."""
    metrics_dir = tmp_path / "prometheus-multiproc"
    metrics_dir.mkdir()
    (metrics_dir / "quotas.bin").write_bytes(struct.pack("<ddq", 0.0, 1.0, 99))
    key = "shared-quota-key-3Vb8"
    proc, url = start_gateway(
        ["--backend", "fake", "--workers", "2"],
        Path(tempfile.gettempdir()) / "gateway-bench-models",
        env={
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "GATEWAY_API_KEYS": f"{key} rate=0.001 burst=10 concurrency=50",
        },
    )
    try:
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def classify(v: int) -> int:
                async with session.post(
                    "/classify",
                    data=png_bytes(solid_image(v, 16)),
                    headers={"content-type": "image/png", "x-api-key": key},
                ) as r:
                    return r.status

            statuses = await asyncio.gather(*(classify(v) for v in range(40)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert statuses.count(200) == 10
    assert statuses.count(429) == 30
    pids = {m.group(1) for f in metrics_dir.iterdir() if (m := re.match(r"counter_(\d+)\.db", f.name))}
    assert len(pids) >= 2, f"only {pids} served: the test did not exercise several workers"
