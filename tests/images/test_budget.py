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
from service.images import budget as budget_module
from service.images.budget import Budget, ByteBudget
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, decoded_bytes, prepare
from service.metrics import Metrics
from service.models.profiles import get_profile


def _holder(budget: Budget, size: int, release: threading.Event, log: list[str], name: str) -> threading.Thread:
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


def test_a_model_within_its_share_does_not_wait_behind_another_models_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models, equal shares (50 bytes each of 100). The flooded one holds 80 and has a 30-byte
    image waiting in line. The other's 20-byte image (within its 50) fits beside the 80 and is
    served at once, out of line; its next 40 bytes would pass its share, so they wait in line
    behind the flood's like any borrower, and get their turn after it."""
    monkeypatch.setattr(budget_module, "HEAD_GRACE", 10.0)  # however slow this machine starts threads
    budget = ByteBudget(100)
    flooded, steady = budget.share(1.0), budget.share(1.0)
    assert (flooded.guaranteed, steady.guaranteed) == (50, 50)
    release_flood, release_steady = threading.Event(), threading.Event()
    log: list[str] = []
    held = _holder(flooded, 80, release_flood, log, "flood-80")
    _until(lambda: log == ["flood-80"])
    queued = _holder(flooded, 30, release_flood, log, "flood-30")
    _until(lambda: budget._queue)
    small = _holder(steady, 20, release_steady, log, "steady-20")
    _until(lambda: "steady-20" in log)  # at once: within its share, and it fits
    assert log == ["flood-80", "steady-20"]
    assert (steady.reserved, flooded.reserved, budget.reserved) == (20, 80, 100)
    over = _holder(steady, 40, release_steady, log, "steady-40")  # 20 + 40 > 50: in line, behind flood-30
    _until(lambda: len(budget._queue) == 2)
    release_flood.set()
    for t in (held, queued):
        t.join(5)
    _until(lambda: len(log) == 4)
    assert log[2:] == ["flood-30", "steady-40"]
    release_steady.set()
    for t in (small, over):
        t.join(5)
    assert (budget.reserved, steady.reserved, flooded.reserved) == (0, 0, 0)


def test_an_image_larger_than_its_share_is_not_starved_by_another_models_small_ones() -> None:
    """Model B's 60-byte image is over its 50-byte share, so it waits in line; model A's stream of
    5-byte images, each within A's share, may pass it only while it has waited less than
    HEAD_GRACE. It is then served next, within a second, where it used to meet its deadline while
    A's images kept the freed bytes."""
    budget = ByteBudget(100)
    a, b = budget.share(1.0), budget.share(1.0)
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            with a.hold(5, deadline=time.monotonic() + 5):
                time.sleep(0.002)

    streams = [threading.Thread(target=stream) for _ in range(12)]  # about 60 bytes of A's held at once
    for thread in streams:
        thread.start()
    try:
        time.sleep(0.1)
        started = time.monotonic()
        with b.hold(60, deadline=started + 3):
            waited = time.monotonic() - started
    finally:
        stop.set()
        for thread in streams:
            thread.join(5)
    assert waited < 1.0
    assert budget.reserved == 0


def test_the_same_wait_without_shares_is_first_come_first_served() -> None:
    """The comparison: one budget without shares, the same reservations: the 20 bytes wait behind
    the 30 in line although they fit (what a flooded model's line did to every other model)."""
    budget = ByteBudget(100)
    release = threading.Event()
    log: list[str] = []
    held = _holder(budget, 80, release, log, "flood-80")
    _until(lambda: log == ["flood-80"])
    queued = _holder(budget, 30, release, log, "flood-30")
    _until(lambda: budget._queue)
    small = _holder(budget, 20, release, log, "steady-20")
    time.sleep(0.1)
    assert log == ["flood-80"]
    release.set()
    for t in (held, queued, small):
        t.join(5)
    assert log == ["flood-80", "flood-30", "steady-20"]


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
    each = decoded_bytes(probe(images[0]), config)
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
