"""The dynamic batcher against a gated fake backend: timing is driven by events, not sleeps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from service.backends.fake import FakeBackend
from service.batching.batcher import DynamicBatcher
from service.batching.items import BatchReport
from service.errors import BackendError, BackendUnavailable, BadImage, DeadlineExceeded, QueueFull
from service.models.profiles import rank_rows, top_k
from tests.conftest import solid_image

Factory = Callable[..., DynamicBatcher]


@pytest.fixture
def fake() -> FakeBackend:
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    return backend


@pytest.fixture
async def make(fake: FakeBackend) -> AsyncIterator[Factory]:
    made: list[DynamicBatcher] = []
    reports: list[BatchReport] = []

    def factory(**kwargs: object) -> DynamicBatcher:
        options: dict[str, object] = {
            "max_batch_size": 4,
            "max_delay": 10.0,
            "max_queue_size": 64,
            "max_inflight_batches": 1,
            "on_batch": reports.append,
        }
        options.update(kwargs)
        batcher = DynamicBatcher(fake.infer, **options)  # type: ignore[arg-type]
        batcher.start()
        made.append(batcher)
        return batcher

    yield factory
    if fake.gate is not None:
        fake.gate.set()
    for batcher in made:
        await batcher.aclose(drain_timeout=1)


def submit(batcher: DynamicBatcher, *values: int, deadline: float | None = None) -> asyncio.Task[list[np.ndarray]]:
    return asyncio.create_task(batcher.submit([solid_image(v, 8) for v in values], deadline=deadline))


def classes(rows: list[np.ndarray]) -> list[int]:
    return [int(row.argmax()) for row in rows]


async def test_lone_request_on_idle_backend_goes_at_once(make: Factory, fake: FakeBackend) -> None:
    """With max_delay 10 s, a request to an idle backend still goes immediately, alone."""
    fake.gate = None
    batcher = make()
    async with asyncio.timeout(2):
        assert classes(await batcher.submit([solid_image(7, 8)])) == [7]
    assert fake.batches == [1]


async def test_batches_fill_to_max_size_while_backend_is_busy(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_batch_size=4, max_inflight_batches=1)
    first = submit(batcher, 1)
    await fake.wait_for_batches(1)
    rest = [submit(batcher, v) for v in range(10, 20)]
    await asyncio.sleep(0)
    assert fake.gate is not None
    fake.gate.set()
    results = await asyncio.gather(first, *rest)
    assert [classes(r)[0] for r in results] == [1, *range(10, 20)]
    assert fake.batches == [1, 4, 4, 2]


async def test_partial_batch_leaves_after_max_delay(make: Factory, fake: FakeBackend) -> None:
    """While the backend is busy, a partial batch waits max_delay for company, then leaves anyway."""
    batcher = make(max_delay=0.05, max_inflight_batches=2)
    loop = asyncio.get_running_loop()
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    sent = loop.time()
    submit(batcher, 2)
    async with asyncio.timeout(2):
        await fake.wait_for_batches(2)
    assert loop.time() - sent >= 0.05
    assert fake.batches == [1, 1]


async def test_full_batch_leaves_without_waiting_for_max_delay(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_delay=10.0, max_batch_size=4, max_inflight_batches=2)
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    submit(batcher, 2, 3)
    submit(batcher, 4, 5)
    async with asyncio.timeout(2):
        await fake.wait_for_batches(2)
    assert fake.batches == [1, 4]


async def test_waiting_batch_leaves_when_backend_goes_idle(make: Factory, fake: FakeBackend) -> None:
    """A partial batch waiting for company leaves as soon as the busy backend becomes idle."""
    batcher = make(max_delay=10.0, max_inflight_batches=2)
    first = submit(batcher, 1)
    await fake.wait_for_batches(1)
    second = submit(batcher, 2)
    await asyncio.sleep(0.01)
    assert fake.batches == [1]  # still waiting to fill
    assert fake.gate is not None
    fake.gate.set()
    async with asyncio.timeout(2):
        assert classes(await first) == [1]
        assert classes(await second) == [2]


async def test_a_free_slot_of_a_backend_busy_only_when_every_slot_is_gets_a_lone_request_at_once(
    make: Factory, fake: FakeBackend
) -> None:
    """``busy_at=2`` (a CPU runtime: each batch on its own cores): with one batch running and a slot
    free, the next request goes at once, alone, instead of waiting max_delay for company; with both
    slots running, the next waits for one, then takes what queued meanwhile."""
    batcher = make(max_delay=10.0, max_batch_size=4, max_inflight_batches=2, busy_at=2)
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    submit(batcher, 2)
    async with asyncio.timeout(2):
        await fake.wait_for_batches(2)
    assert fake.batches == [1, 1]
    waiting = [submit(batcher, v) for v in (3, 4, 5)]
    await asyncio.sleep(0.01)
    assert fake.batches == [1, 1]  # no slot free
    assert fake.gate is not None
    fake.gate.set()
    async with asyncio.timeout(2):
        assert [classes(await task)[0] for task in waiting] == [3, 4, 5]
    assert fake.batches == [1, 1, 3]


async def test_every_caller_gets_its_own_result(make: Factory, fake: FakeBackend) -> None:
    fake.gate = None
    batcher = make(max_batch_size=8, max_delay=0.002, max_inflight_batches=2, max_queue_size=256)
    tasks = [submit(batcher, v, v + 1) for v in range(0, 200, 2)]
    results = await asyncio.gather(*tasks)
    assert [classes(r) for r in results] == [[v, v + 1] for v in range(0, 200, 2)]
    assert max(fake.batches) <= 8
    assert sum(fake.batches) == 200


async def test_queue_full_rejects_whole_requests(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_queue_size=4)
    submit(batcher, 1)
    await fake.wait_for_batches(1)  # in the backend, no longer queued
    queued = submit(batcher, 2, 3, 4)
    await asyncio.sleep(0)
    assert batcher.queue_depth == 3
    with pytest.raises(QueueFull) as info:
        await batcher.submit([solid_image(5, 8), solid_image(6, 8)])
    assert info.value.headers["Retry-After"] == "1"
    assert batcher.queue_depth == 3  # nothing of the refused request was admitted
    assert fake.gate is not None
    fake.gate.set()
    assert classes(await queued) == [2, 3, 4]


async def test_deadline_frees_the_queue_slot(make: Factory, fake: FakeBackend) -> None:
    batcher = make()
    loop = asyncio.get_running_loop()
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit([solid_image(2, 8)], deadline=loop.time() + 0.05)
    assert batcher.queue_depth == 0
    later = submit(batcher, 3)
    assert fake.gate is not None
    fake.gate.set()
    assert classes(await later) == [3]
    assert fake.batches == [1, 1]  # the expired image never reached the backend


async def test_cancelled_request_is_dropped_before_its_batch(make: Factory, fake: FakeBackend) -> None:
    """A client that disconnects while queued is removed; its neighbours are served normally."""
    batcher = make(max_inflight_batches=1)
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    doomed = submit(batcher, 2)
    kept = submit(batcher, 3)
    await asyncio.sleep(0)
    doomed.cancel()
    await asyncio.wait([doomed])
    assert batcher.queue_depth == 1
    assert fake.gate is not None
    fake.gate.set()
    assert classes(await kept) == [3]
    assert fake.batches == [1, 1]


async def test_cancelled_request_inside_a_running_batch_harms_no_one(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_batch_size=4, max_inflight_batches=1)
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    doomed, kept = submit(batcher, 2), submit(batcher, 3)
    assert fake.gate is not None
    fake.gate.set()
    await fake.wait_for_batches(2)
    fake.gate.clear()
    # the second batch [2, 3] is gated again in the backend; cancel one of its requests
    doomed.cancel()
    await asyncio.sleep(0)
    fake.gate.set()
    assert classes(await kept) == [3]
    with pytest.raises(asyncio.CancelledError):
        await doomed


async def test_backend_failure_reaches_every_request_of_the_batch(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_batch_size=4, max_inflight_batches=1)
    submit(batcher, 1)
    await fake.wait_for_batches(1)
    a, b = submit(batcher, 2), submit(batcher, 3)
    fake.fail_next = RuntimeError("CUDA error: an illegal memory access")
    assert fake.gate is not None
    fake.gate.set()
    for task in (a, b):
        with pytest.raises(BackendError, match=r"failed on the batch \(RuntimeError\)"):  # its text: logged
            await task
    assert classes(await batcher.submit([solid_image(4, 8)])) == [4]  # the next batch is fine


async def test_wrong_result_count_fails_the_batch(make: Factory, fake: FakeBackend) -> None:
    fake.gate = None
    fake.drop_one_row = True
    batcher = make()
    with pytest.raises(BackendError, match="returned 1 results for a batch of 2"):
        await batcher.submit([solid_image(1, 8), solid_image(2, 8)])


async def test_close_drains_queued_work_then_refuses(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_inflight_batches=1)
    a = submit(batcher, 1)
    await fake.wait_for_batches(1)
    b = submit(batcher, 2)
    await asyncio.sleep(0)
    closing = asyncio.create_task(batcher.aclose(drain_timeout=5))
    await asyncio.sleep(0)
    with pytest.raises(BackendUnavailable, match="shutting down"):
        await batcher.submit([solid_image(3, 8)])
    assert fake.gate is not None
    fake.gate.set()
    await closing
    assert classes(await a) == [1]
    assert classes(await b) == [2]


async def test_close_after_drain_timeout_fails_what_is_left(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_inflight_batches=1)
    a = submit(batcher, 1)
    await fake.wait_for_batches(1)
    b = submit(batcher, 2)
    await asyncio.sleep(0)
    await batcher.aclose(drain_timeout=0.05)
    for task in (a, b):
        with pytest.raises(BackendUnavailable, match="shut down"):
            await task


async def test_reports_batches_for_metrics(fake: FakeBackend) -> None:
    fake.gate = None
    reports: list[BatchReport] = []
    batcher = DynamicBatcher(
        fake.infer, max_batch_size=4, max_delay=0, max_queue_size=8, max_inflight_batches=1, on_batch=reports.append
    )
    batcher.start()
    await batcher.submit([solid_image(1, 8), solid_image(2, 8), solid_image(3, 8)])
    await batcher.aclose()
    assert [r.size for r in reports] == [3]
    assert reports[0].error is None
    assert len(reports[0].queue_waits) == 3


async def test_prepared_images_join_batches_with_submitted_ones(make: Factory, fake: FakeBackend) -> None:
    """``submit_prepared`` decodes in the pool and queues from there: its image shares a batch with
    other requests', and gets its own row."""
    batcher = make(max_batch_size=3)
    first = submit(batcher, 1)
    await fake.wait_for_batches(1)
    with ThreadPoolExecutor(1) as pool:
        prepared = asyncio.create_task(batcher.submit_prepared(lambda: solid_image(2, 8), pool))
        second = submit(batcher, 3, 4)
        while batcher.queue_depth < 3:  # noqa: ASYNC110 (the depth has no event to wait on)
            await asyncio.sleep(0.01)
        assert fake.gate is not None
        fake.gate.set()
        assert classes([await prepared]) == [2]
    assert classes(await first) == [1]
    assert classes(await second) == [3, 4]
    assert fake.batches == [1, 3]


async def test_a_prepare_error_fails_its_request_only(make: Factory, fake: FakeBackend) -> None:
    fake.gate = None
    batcher = make()

    def broken() -> np.ndarray:
        raise BadImage("not an image")

    with ThreadPoolExecutor(2) as pool:
        bad = asyncio.create_task(batcher.submit_prepared(broken, pool))
        good = asyncio.create_task(batcher.submit_prepared(lambda: solid_image(5, 8), pool))
        with pytest.raises(BadImage):
            await bad
        assert classes([await good]) == [5]
    assert fake.batches == [1]


async def test_the_deadline_covers_preparing(make: Factory, fake: FakeBackend) -> None:
    """A request whose image is still being decoded at its deadline gets 504 then; the image, once
    decoded, is not queued."""
    fake.gate = None
    batcher = make()
    release = threading.Event()

    def slow() -> np.ndarray:
        release.wait(5)
        return solid_image(6, 8)

    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(DeadlineExceeded):
            await batcher.submit_prepared(slow, pool, deadline=loop.time() + 0.05)
        release.set()
    await asyncio.sleep(0.05)  # the late image's hand-back has run
    assert batcher.queue_depth == 0
    assert fake.batches == []


async def test_prepared_images_respect_the_queue_limit(make: Factory, fake: FakeBackend) -> None:
    batcher = make(max_queue_size=2)
    running = submit(batcher, 1)
    await fake.wait_for_batches(1)
    queued = submit(batcher, 2, 3)
    with ThreadPoolExecutor(1) as pool, pytest.raises(QueueFull):
        await batcher.submit_prepared(lambda: solid_image(4, 8), pool)
    assert fake.gate is not None
    fake.gate.set()
    assert classes(await running) == [1]
    assert classes(await queued) == [2, 3]


async def test_a_ranking_batcher_answers_each_image_with_its_rows_best_classes(
    make: Factory, fake: FakeBackend
) -> None:
    """With ``rank`` the batch is ranked once and each request gets its own rows' answers, in order."""
    ranked_batches: list[int] = []

    def rank(scores: np.ndarray) -> list[list[tuple[int, float]]]:
        ranked_batches.append(len(scores))
        return rank_rows(scores, 3)

    batcher = make(rank=rank)
    first, second = submit(batcher, 11, 12), submit(batcher, 13)
    await asyncio.sleep(0.05)
    assert fake.gate is not None
    fake.gate.set()
    one, two = await first, await second
    assert ranked_batches == [3]
    assert [row[0][0] for row in one + two] == [11, 12, 13]  # the fake backend's class is the red value
    assert all(len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] for row in one + two)


def test_ranking_a_batch_gives_each_rows_top_k() -> None:
    rng = np.random.default_rng(7)
    scores = rng.random((9, 1000)).astype(np.float32)  # distinct values: one right answer per row
    for k in (1, 5, 20):
        assert rank_rows(scores, k) == [top_k(row, k) for row in scores]
    tied = np.zeros((2, 6), np.float32)
    tied[:, 3] = 1.0
    for row in rank_rows(tied, 3):  # equal scores: the lower class index first
        assert row[0] == (3, 1.0)
        assert row[1][0] < row[2][0]


async def test_an_idle_batcher_holds_no_image() -> None:
    """Once a batch is answered and its requests are done, nothing in the batcher references its
    images (the shared engine's cells are free again only then): the batch loop used to keep its
    last batch while it waited for the next."""
    import gc
    import weakref

    batcher = DynamicBatcher(
        FakeBackend().infer, max_batch_size=4, max_delay=0.001, max_queue_size=8, max_inflight_batches=1
    )
    batcher.start()
    images = [solid_image(i) for i in range(3)]
    alive = [weakref.ref(image) for image in images]
    gc.disable()  # only references, not the cycle collector, may free them here
    try:
        await batcher.submit(images)
        del images
        await asyncio.sleep(0.05)
        assert [ref() for ref in alive] == [None, None, None]
    finally:
        gc.enable()
        await batcher.aclose()
