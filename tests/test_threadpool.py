"""The thread pool that completes asyncio futures directly."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.threadpool import ThreadPool


async def test_results_and_errors_reach_the_caller_from_worker_threads() -> None:
    pool = ThreadPool(2, "test")
    try:
        names = await asyncio.gather(*(pool.submit(lambda: threading.current_thread().name) for _ in range(8)))
        assert set(names) <= {"test_0", "test_1"}
        assert await pool.submit(pow, 2, 10) == 1024
        with pytest.raises(ZeroDivisionError):
            await pool.submit(lambda: 1 / 0)
    finally:
        pool.shutdown()


async def test_a_caller_that_gave_up_does_not_break_the_pool() -> None:
    """A cancelled or timed-out caller's result is dropped; the next call is served."""
    pool = ThreadPool(1, "test")
    try:
        slow = pool.submit(time.sleep, 0.2)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await slow
        assert await pool.submit(lambda: "next") == "next"
    finally:
        pool.shutdown()


async def test_shutdown_finishes_queued_work() -> None:
    pool = ThreadPool(1, "test")
    done: list[int] = []
    futures = [pool.submit(done.append, i) for i in range(5)]
    await asyncio.to_thread(pool.shutdown)
    await asyncio.gather(*futures)
    assert done == [0, 1, 2, 3, 4]
