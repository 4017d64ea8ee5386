"""SIGTERM under load: the gateway stops accepting, finishes what it took, then exits."""

from __future__ import annotations

import asyncio
import re
import signal
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from loadtests.harness.http_load import start_gateway
from tests.conftest import png_bytes, solid_image


async def _queued(session: aiohttp.ClientSession) -> float:
    async with session.get("/metrics") as r:
        match = re.search(r"^gateway_batcher_queue_depth\{[^}]*\} (\S+)$", await r.text(), re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.slow
async def test_sigterm_under_load_loses_no_accepted_request() -> None:
    proc, url = start_gateway(
        ["--backend", "fake", "--fake-delay", "0.3", "--max-batch-size", "4", "--max-inflight-batches", "1"],
        Path(tempfile.gettempdir()) / "gateway-bench-models",
    )
    try:
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=100)) as session:

            async def classify(value: int) -> tuple[int, int]:
                body = png_bytes(solid_image(value, 16))
                async with session.post("/classify", data=body, headers={"content-type": "image/png"}) as r:
                    payload = await r.json()
                    return r.status, payload["results"][0]["labels"][0]["index"] if r.status == 200 else -1

            tasks = [asyncio.create_task(classify(v)) for v in range(30)]
            async with asyncio.timeout(30):  # black-box: wait until the server reports them queued
                while await _queued(session) < 20:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            results = await asyncio.gather(*tasks)
        assert results == [(200, v) for v in range(30)]  # every accepted request answered, correctly
        with pytest.raises(aiohttp.ClientConnectionError):  # no new work is taken
            async with aiohttp.ClientSession(url) as late, late.get("/healthz") as r:
                await r.read()
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 30
    finally:
        if proc.poll() is None:
            proc.kill()
