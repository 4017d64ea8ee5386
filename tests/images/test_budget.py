"""The decoder-memory budget shared by the decode threads: bounded, first come first served, and
never holding a request past its deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from loadtests.harness.photos import noise_png
from service.batching.batcher import DynamicBatcher
from service.classifier import Classifier, ImageInput
from service.errors import BadImage, DeadlineExceeded
from service.images.budget import ByteBudget
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, decoded_bytes, prepare
from service.metrics import Metrics
from service.models.profiles import get_profile


def _holder(budget: ByteBudget, size: int, release: threading.Event, log: list[str], name: str) -> threading.Thread:
    def run() -> None:
        with budget.hold(size):
            log.append(name)
            release.wait(5)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def _until(condition: object, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_reservations_run_together_while_they_fit_and_wait_beyond() -> None:
    waits: list[int] = []
    budget = ByteBudget(100, on_wait=lambda: waits.append(1))
    release_first, release_rest = threading.Event(), threading.Event()
    log: list[str] = []
    a = _holder(budget, 60, release_first, log, "a")
    b = _holder(budget, 40, release_rest, log, "b")
    _until(lambda: len(log) == 2)
    assert budget.reserved == 100
    assert not waits
    c = _holder(budget, 30, release_rest, log, "c")
    time.sleep(0.1)
    assert log == ["a", "b"]
    assert waits == [1]
    release_first.set()
    _until(lambda: len(log) == 3)
    assert log[2] == "c"
    assert budget.reserved == 70
    release_rest.set()
    for t in (a, b, c):
        t.join(5)
    assert budget.reserved == 0


def test_a_large_reservation_is_not_overtaken_by_small_ones() -> None:
    """First come, first served: once a large image waits, later small ones queue behind it rather
    than keep the budget busy for ever."""
    budget = ByteBudget(100)
    release_small, release_large = threading.Event(), threading.Event()
    log: list[str] = []
    first = _holder(budget, 50, release_small, log, "small-1")
    _until(lambda: log == ["small-1"])
    large = _holder(budget, 100, release_large, log, "large")
    _until(lambda: budget._queue)  # the large one is in line
    later = _holder(budget, 10, release_small, log, "small-2")  # would fit now, but arrived later
    time.sleep(0.1)
    assert log == ["small-1"]
    release_small.set()
    _until(lambda: len(log) == 2)
    assert log[1] == "large"
    release_large.set()
    for t in (first, large, later):
        t.join(5)
    assert log == ["small-1", "large", "small-2"]
    assert budget.reserved == 0


def test_a_wait_ends_at_the_deadline_with_nothing_reserved_and_the_line_moves_on() -> None:
    budget = ByteBudget(100)
    release = threading.Event()
    log: list[str] = []
    holder = _holder(budget, 80, release, log, "holder")
    _until(lambda: log == ["holder"])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="decoder memory"), budget.hold(50, deadline=started + 0.2):
        pytest.fail("reserved past the budget")
    assert 0.15 <= time.monotonic() - started < 2
    assert budget.reserved == 80
    assert not budget._queue
    with budget.hold(20, deadline=time.monotonic() + 1):  # fits beside the holder: no wait
        assert budget.reserved == 100
    release.set()
    holder.join(5)
    assert budget.reserved == 0


def test_a_reservation_larger_than_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="can never fit"), ByteBudget(100).hold(101):
        pytest.fail("reserved more than the whole budget")


def test_the_budget_is_given_back_when_decoding_fails(cat_jpeg: bytes) -> None:
    budget = ByteBudget(10_000_000)
    with pytest.raises(BadImage, match="could not be decoded"):
        prepare(cat_jpeg[: len(cat_jpeg) // 2], PreprocessConfig(), budget)
    assert budget.reserved == 0
    assert prepare(cat_jpeg, PreprocessConfig(), budget).shape == (224, 224, 3)
    assert budget.reserved == 0


async def test_many_threads_decode_within_the_shared_budget() -> None:
    """Eight threads and a budget for two of these images at a time: every image is decoded right,
    the reserved bytes never pass the budget, and images waited their turn."""
    images = [noise_png(900, seed) for seed in range(12)]
    config = PreprocessConfig()
    each = decoded_bytes(probe(images[0]), config.needed_short_side)
    waits: list[int] = []
    budget = ByteBudget(2 * each, on_wait=lambda: waits.append(1))
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(budget.reserved)
            time.sleep(0.0005)

    pool = ThreadPoolExecutor(8, thread_name_prefix="preprocess")
    batcher = DynamicBatcher(
        lambda batch, timeout=None: asyncio.sleep(0),
        max_batch_size=1,
        max_delay=0,
        max_queue_size=1,
        max_inflight_batches=1,
    )
    classifier = Classifier(get_profile("trivial"), batcher, pool, Metrics(), config, budget)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        arrays = await classifier.preprocess([ImageInput(data) for data in images])
    finally:
        done.set()
        watcher.join()
        pool.shutdown()
    for data, array in zip(images, arrays, strict=True):
        assert np.array_equal(array, prepare(data, config))
    assert max(seen) <= 2 * each
    assert each in seen or 2 * each in seen  # the watcher saw decoding happen
    assert waits  # eight threads, room for two: the rest waited
    assert budget.reserved == 0
