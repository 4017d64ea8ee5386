"""Fair sharing between models: weighted admission that lends what others leave unused, and a
decode pool whose threads go to the models' lanes in weighted order, never in arrival order."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.errors import QueueFull
from service.serving.fair import Admission, FairPool


def test_admission_lends_idle_shares_but_keeps_a_reserve_for_each_model() -> None:
    admission = Admission(20, {"flooded": 1.0, "steady": 1.0})
    assert (admission.guaranteed, admission.reserve) == ({"flooded": 10, "steady": 10}, {"flooded": 2, "steady": 2})
    while admission.room("flooded"):
        admission.enter("flooded")
    assert admission.active["flooded"] == 18  # all but the steady model's reserve
    with pytest.raises(QueueFull, match="model 'flooded' has 18 requests in progress"):
        admission.check("flooded")
    admission.enter("steady")  # its reserve, at once
    admission.enter("steady")
    assert not admission.room("steady")  # the total is full now
    admission.leave("flooded")  # a flooded request finishes: its slot is the steady model's
    assert not admission.room("flooded")
    assert admission.room("steady")
    admission.enter("steady")
    with pytest.raises(QueueFull, match="20 requests are already being handled"):
        admission.check("steady")


def test_a_model_below_its_guarantee_is_always_let_in_while_there_is_room() -> None:
    admission = Admission(10, {"a": 3.0, "b": 1.0})
    assert admission.guaranteed == {"a": 7, "b": 2}
    while admission.room("a"):
        admission.enter("a")
    assert admission.active["a"] == 9  # b's reserve (1) stays free
    admission.enter("b")
    admission.leave("a")
    admission.reshare({"a": 1.0, "b": 1.0})  # a reload: the same models, new weights
    assert admission.guaranteed == {"a": 5, "b": 5}
    assert not admission.room("a")  # 8 active, over its new share; b's reserve stays free
    assert admission.room("b")


def test_more_models_than_slots_share_everything() -> None:
    admission = Admission(2, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert admission.guaranteed == {"a": 0, "b": 0, "c": 0}
    admission.enter("a")
    admission.enter("a")
    assert not admission.room("b")


async def test_the_pool_serves_lanes_in_weighted_order_not_arrival_order() -> None:
    """One thread; a flooded lane queues 30 tasks before a lane of share 1 queues 3: each of the
    quiet lane's tasks runs within two of the flood's, not after all 30."""
    threads = ThreadPoolExecutor(1)
    pool = FairPool(threads, 1)
    flood, quiet = pool.lane(1.0), pool.lane(1.0)
    order: list[str] = []
    gate = threading.Event()
    loop = asyncio.get_running_loop()
    first = loop.run_in_executor(flood, gate.wait)  # holds the one thread
    flooded = [loop.run_in_executor(flood, order.append, "flood") for _ in range(30)]
    quiet_tasks = [loop.run_in_executor(quiet, order.append, "quiet") for _ in range(3)]
    gate.set()
    await asyncio.gather(first, *flooded, *quiet_tasks)
    threads.shutdown()
    assert [i for i, who in enumerate(order) if who == "quiet"] == [0, 2, 4]


async def test_a_weighted_lane_gets_its_share_of_the_threads() -> None:
    threads = ThreadPoolExecutor(1)
    pool = FairPool(threads, 1)
    heavy, light = pool.lane(3.0), pool.lane(1.0)
    order: list[str] = []
    gate = threading.Event()
    loop = asyncio.get_running_loop()
    first = loop.run_in_executor(light, gate.wait)
    tasks = [loop.run_in_executor(heavy, order.append, "heavy") for _ in range(12)]
    tasks += [loop.run_in_executor(light, order.append, "light") for _ in range(12)]
    gate.set()
    await asyncio.gather(first, *tasks)
    threads.shutdown()
    assert order[:16].count("heavy") == 12  # 3 of every 4 while both wait
    assert order[16:] == ["light"] * 8


async def test_a_cancelled_task_never_runs_and_its_thread_goes_to_the_next() -> None:
    threads = ThreadPoolExecutor(1)
    pool = FairPool(threads, 1)
    lane = pool.lane(1.0)
    ran: list[int] = []
    gate = threading.Event()
    loop = asyncio.get_running_loop()
    first = loop.run_in_executor(lane, gate.wait)
    doomed = loop.run_in_executor(lane, ran.append, 1)
    kept = loop.run_in_executor(lane, ran.append, 2)
    doomed.cancel()
    await asyncio.sleep(0)  # the cancel reaches the pool's future in a callback of the loop's
    gate.set()
    await asyncio.gather(first, kept)
    threads.shutdown()
    assert ran == [2]


async def test_an_exception_reaches_its_caller_and_frees_the_thread() -> None:
    threads = ThreadPoolExecutor(1)
    lane = FairPool(threads, 1).lane(1.0)
    loop = asyncio.get_running_loop()
    with pytest.raises(ZeroDivisionError):
        await loop.run_in_executor(lane, divmod, 1, 0)
    assert await loop.run_in_executor(lane, divmod, 7, 2) == (3, 1)
    threads.shutdown()
