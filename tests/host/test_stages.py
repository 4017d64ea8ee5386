"""The serving path's stage timings (``gateway_stage_seconds``): each stage measures what it names,
and the pauses that delay every request at once (a blocked loop, a collection) are seen."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from service.backends.fake import FakeBackend
from service.batching.batcher import DynamicBatcher
from service.host.stages import STAGES, PauseWatch, stage_histogram, stage_observer
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image


class Recorded:
    """``observe`` that keeps every (stage, seconds)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {}

    def __call__(self, stage: str, seconds: float) -> None:
        assert stage in STAGES
        self.seen.setdefault(stage, []).append(seconds)


async def test_a_blocked_loop_and_a_full_collection_are_seen() -> None:
    recorded = Recorded()
    watch = PauseWatch(recorded, interval=0.01)
    watch.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.08)  # noqa: ASYNC251 (the loop blocked, as by a slow callback)
        await asyncio.sleep(0.03)
        gc.collect()  # the oldest generation: every thread stopped meanwhile
    finally:
        watch.stop()
    lags = recorded.seen["loop_lag"]
    assert max(lags) >= 0.06
    assert sorted(lags)[len(lags) // 2] < 0.03  # the others on time
    assert recorded.seen["gc"]
    assert all(0 <= s < 5 for s in recorded.seen["gc"])
    # stopped: nothing more is observed
    before = sum(len(v) for v in recorded.seen.values())
    gc.collect()
    await asyncio.sleep(0.05)
    assert sum(len(v) for v in recorded.seen.values()) == before


async def test_each_stage_of_an_image_sent_alone_measures_its_own_wait() -> None:
    """A decode that waits for the pool's one thread, a slow decode, a slow backend: each lands in
    its own stage, and the stages add up to about what the caller waited."""
    recorded = Recorded()
    backend = FakeBackend(delay=0.05)
    batcher = DynamicBatcher(
        backend.infer, max_batch_size=4, max_delay=0.0, max_queue_size=16, max_inflight_batches=1, on_stage=recorded
    )
    batcher.start()
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(time.sleep, 0.04)  # the one decode thread busy for 40 ms

        def decode() -> np.ndarray:
            time.sleep(0.03)
            return np.zeros((4, 4, 3), np.uint8)

        started = time.perf_counter()
        await batcher.submit_prepared(decode, pool)
        waited = time.perf_counter() - started
    finally:
        await batcher.aclose()
        pool.shutdown()
    seen = {stage: values[0] for stage, values in recorded.seen.items()}
    assert set(seen) == {"decode_queue", "decode", "to_loop", "batch_wait", "backend", "wake"}
    assert 0.03 <= seen["decode_queue"] < 0.2
    assert 0.025 <= seen["decode"] < 0.2
    assert 0.045 <= seen["backend"] < 0.3
    assert seen["batch_wait"] < 0.02
    assert seen["to_loop"] < 0.02
    assert seen["wake"] < 0.02
    assert sum(seen.values()) == pytest.approx(waited, abs=0.02)


async def test_an_image_waits_in_the_batcher_while_the_backend_is_busy() -> None:
    recorded = Recorded()
    backend = FakeBackend(delay=0.06)
    batcher = DynamicBatcher(
        backend.infer, max_batch_size=8, max_delay=1.0, max_queue_size=16, max_inflight_batches=1, on_stage=recorded
    )
    batcher.start()
    try:
        first = asyncio.create_task(batcher.submit([np.zeros((2, 2, 3), np.uint8)]))
        await backend.wait_for_batches(1)
        await batcher.submit([np.zeros((2, 2, 3), np.uint8)])  # queued until the first batch is back
        await first
    finally:
        await batcher.aclose()
    waits = sorted(recorded.seen["batch_wait"])
    assert waits[0] < 0.02
    assert 0.04 <= waits[1] < 0.3
    assert len(recorded.seen["backend"]) == 2  # once per batch
    assert "decode" not in recorded.seen  # the images came decoded


def test_the_engine_records_its_batcher_under_its_own_names() -> None:
    registry = CollectorRegistry()
    observe = stage_observer(stage_histogram(registry), renamed={"batch_wait": "engine_wait", "backend": "gpu"})
    observe("batch_wait", 0.004)
    observe("backend", 0.002)
    count: Callable[[str], float | None] = lambda stage: registry.get_sample_value(  # noqa: E731
        "gateway_stage_seconds_count", {"stage": stage}
    )
    assert count("engine_wait") == 1
    assert count("gpu") == 1
    assert count("batch_wait") == 0
    assert count("backend") == 0


async def test_metrics_show_the_stages_of_a_request(gateway_factory: Callable[..., Settings]) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        for value in range(3):
            r = await client.post(
                "/classify", content=png_bytes(solid_image(value, 16)), headers={"content-type": "image/png"}
            )
            assert r.status_code == 200
        text = (await client.get("/metrics")).text
    for stage in ("decode_queue", "decode", "to_loop", "batch_wait", "wake"):
        assert f'gateway_stage_seconds_count{{stage="{stage}"}} 3.0' in text, stage
    assert 'gateway_stage_seconds_bucket{le="0.015",stage="backend"}' in text
    assert 'gateway_stage_seconds_count{stage="loop_lag"}' in text
