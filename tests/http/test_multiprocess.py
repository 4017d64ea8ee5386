"""Several uvicorn workers: /metrics counts every worker's requests once, whichever answers it."""

from __future__ import annotations

import asyncio
import re
import signal
import struct
import tempfile
from pathlib import Path

import aiohttp
import psutil
import pytest

from loadtests.harness.http_load import start_gateway
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
        assert (
            value(text, 'gateway_images_classified_total{mode="online",model="efficientnet-lite0",version="1"}') == 40
        )
        assert value(text, 'gateway_http_requests_total{method="POST",route="/classify",status="200"}') == 40
        assert value(text, 'gateway_batch_size_sum{model="efficientnet-lite0",version="1"}') == 40
    pids = {m.group(1) for f in metrics_dir.iterdir() if (m := re.match(r"counter_(\d+)\.db", f.name))}
    assert len(pids) >= 2, f"only {pids} served: the test did not exercise several workers"


@pytest.mark.slow
async def test_a_keys_rate_holds_over_all_workers(tmp_path: Path) -> None:
    """Workers share one quota table: a key with a burst of 10 and no refill to speak of gets 10
    images through in total, not 10 per worker. A table left by an earlier run (here: a bucket
    last refilled in the far future, so empty for ever) is cleared at start."""
    metrics_dir = tmp_path / "prometheus-multiproc"
    metrics_dir.mkdir()
    (metrics_dir / "quotas.bin").write_bytes(struct.pack("<dd", 0.0, 1e18))
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


@pytest.mark.slow
async def test_a_sigkilled_workers_request_stops_counting(tmp_path: Path) -> None:
    """A worker SIGKILLed while a request of a key allowed one at a time is in progress on it (an
    upload stalled halfway) leaves nothing counted: the key, refused while that request was in
    progress, is served at the first try once the worker is gone, by the same gateway (no restart)."""
    key = "serial-quota-key-8Tz1"
    proc, url = start_gateway(
        ["--backend", "fake", "--workers", "2", "--body-timeout", "300"],
        Path(tempfile.gettempdir()) / "gateway-bench-models",
        env={
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus-multiproc"),
            "GATEWAY_API_KEYS": f"{key} concurrency=1",
        },
    )
    body = png_bytes(solid_image(1, 16))
    _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        head = f"POST /classify HTTP/1.1\r\nhost: gateway\r\nx-api-key: {key}\r\ncontent-type: image/png\r\n"
        writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body[:8])  # and never the rest
        await writer.drain()
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def classify() -> int:
                headers = {"content-type": "image/png", "x-api-key": key}
                async with session.post("/classify", data=body, headers=headers) as r:
                    return r.status

            deadline = asyncio.get_running_loop().time() + 30
            while (status := await classify()) != 429:  # until the stalled request is in progress
                assert status == 200
                assert asyncio.get_running_loop().time() < deadline
            stalled_port = writer.get_extra_info("sockname")[1]
            holder = next(
                worker
                for worker in psutil.Process(proc.pid).children()
                if any(c.raddr and c.raddr.port == stalled_port for c in worker.net_connections("tcp"))
            )
            holder.kill()
            holder.wait(timeout=30)  # gone: uvicorn has reaped it (and starts another)
            assert await classify() == 200
        assert proc.poll() is None
    finally:
        writer.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
