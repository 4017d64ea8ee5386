"""Fair sharing between models: of admission (requests in progress) and of the decode threads.

Each model has a weight, its ``share``. A flooded model must not starve the others, and a quiet
gateway must not leave a busy model idle: both schemes guarantee every model its part of the
resource and let a model borrow what the others leave unused.

* ``Admission``: of ``limit`` requests in progress (or bytes: the request bodies being received,
  ``amount`` at a time), model m is guaranteed
  ``g_m = limit x share_m / sum(shares)``; beyond that it may borrow free slots, but always leaves
  each other model j a reserve of ``min(g_j - active_j, max(1, g_j / 4))`` free slots. j's next
  requests take those at once, and the slots the borrower frees as its requests finish go back to
  j until j has its guarantee: a busy model alone may use all but a quarter of the others'
  guarantees, and a model flooded at any rate cannot keep another from its share.
* ``FairPool``: decode tasks wait in one lane per model and go to the thread pool, at most one
  per thread, in weighted fair order (start-time fair queueing: the lane whose next task has the
  least virtual start time goes first, each task advancing its lane by ``1 / share``). A lane
  idle for a while restarts at the current virtual time: idling earns no credit to burst with.
  The pool's own FIFO queue never fills, so one model's backlog cannot stand between another
  model's image and a thread.

A request may be admitted from its head, before its body is read (``reserve_slot``): its slot is taken
then, so that no request admitted later takes it while the body arrives, and the request claims it
when it starts (``claim``). One whose body takes longer than ``RESERVATION_SECONDS`` loses it (and
is checked again once read, as every request was before), so a slow sender holds a slot a quarter
of a second at most. Reservations are not capped: a cap leaves the heads beyond it admitted without
a slot, all seeing the same free ones and racing for them with their bodies (a cap of a quarter,
then of half, of the slots did that at every burst of clients: bodies read only to be refused).

A refusal says when to retry (``Admission.retry_after``): the time the requests in progress take
to drain at the rate the last ``limit`` of them finished, spread by up to half again so that the
clients refused together do not all come back together.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from service.errors import QueueFull

RESERVATION_SECONDS = 0.25
"""The most a slot is held for a request admitted from its head while its body arrives."""

P = ParamSpec("P")
T = TypeVar("T")


class Reservation:
    """A slot taken for a request admitted from its head (``Admission.reserve_slot``)."""

    __slots__ = ("admission", "expires", "model")

    def __init__(self, admission: Admission, model: str, expires: float) -> None:
        self.admission = admission
        self.model = model
        self.expires = expires

    def holds(self, model: str) -> bool:
        """Whether this still holds a slot of ``model`` (not claimed, released or expired)."""
        return self.model == model and self in self.admission.reservations

    def release(self) -> None:
        """Give the slot back unless the request claimed it (idempotent)."""
        self.admission.release(self)


class Admission:
    """Requests in progress, per model, within one limit shared by weight (see the module's text)."""

    reserve: dict[str, int]

    def __init__(self, limit: int, shares: Mapping[str, float], fair: bool = True, *, longest: float = 60.0) -> None:
        """``fair`` False: one limit, first come first served (nothing guaranteed, nothing kept).
        ``longest``: the most seconds a request may be in progress (the most ``retry_after`` says)."""
        self.limit = limit
        self.fair = fair
        self.longest = longest
        self.active = dict.fromkeys(shares, 0)
        self.total = 0
        self.guaranteed: dict[str, int] = {}
        self.finished: deque[float] = deque(maxlen=max(2, min(limit, 1024)))
        """When the latest requests left (monotonic seconds): the drain rate ``retry_after`` measures."""
        self.reservations: dict[Reservation, None] = {}
        """Slots taken for requests whose bodies are arriving, oldest first."""
        self.reshare(shares)

    def reshare(self, shares: Mapping[str, float]) -> None:
        """New weights (a reloaded models file)."""
        for name in shares:
            self.active.setdefault(name, 0)
        total = sum(shares.values())
        guaranteed = {name: max(1, int(self.limit * share / total)) for name, share in shares.items()}
        if sum(guaranteed.values()) > self.limit or not self.fair:  # more models than slots: all shared
            guaranteed = dict.fromkeys(shares, 0)
        self.guaranteed = guaranteed
        self.reserve = {name: max(1, g // 4) if g else 0 for name, g in guaranteed.items()}
        """Free slots kept for each model below its guarantee, whoever borrows."""

    def room(self, model: str, amount: int = 1) -> bool:
        """Whether ``model`` may start one more request now (take ``amount`` more)."""
        if self.reservations:
            self._expire()
        if self.total + amount > self.limit:
            return False
        if self.active.get(model, 0) + amount <= self.guaranteed.get(model, 0):  # a model removed: none
            return True
        kept = sum(
            min(max(0, guaranteed - self.active[name]), self.reserve[name])
            for name, guaranteed in self.guaranteed.items()
            if name != model
        )
        return self.total + amount + kept <= self.limit

    def check(self, model: str) -> None:
        if not self.room(model):
            retry = self.retry_after()
            if self.total >= self.limit:
                raise QueueFull(f"{self.limit} requests are already being handled; retry later", retry_after=retry)
            raise QueueFull(
                f"model {model!r} has {self.active.get(model, 0)} requests in progress, its share and all it may "
                "borrow from the other models now; retry later",
                retry_after=retry,
            )

    def drain_seconds(self) -> float:
        """Seconds the requests in progress take to finish at the rate the latest ones did (from
        the first of them to now, so that a stalled backend reads as slow): ``longest`` until
        two have finished."""
        finished = self.finished
        if len(finished) < 2:
            return self.longest
        per_request = (time.monotonic() - finished[0]) / (len(finished) - 1)
        return min(self.longest, self.total * per_request)

    def retry_after(self) -> int:
        """``Retry-After`` for a refusal now: ``drain_seconds`` spread by up to half again, whole
        seconds (at least 1, at most ``longest``)."""
        spread = self.drain_seconds() * (1.0 + random.random() / 2)
        return max(1, min(math.ceil(self.longest), math.ceil(spread)))

    def forget(self, model: str) -> None:
        """A model a reload removed, once its last request has left."""
        if not self.active.get(model):
            self.active.pop(model, None)

    def enter(self, model: str, amount: int = 1) -> None:
        self.active[model] = self.active.get(model, 0) + amount
        self.total += amount

    def leave(self, model: str, amount: int = 1) -> None:
        self.active[model] -= amount
        self.total -= amount
        self.finished.append(time.monotonic())

    def reserve_slot(self, model: str) -> Reservation:
        """Take a slot of ``model`` for a request admitted from its head (after ``check``)."""
        self.enter(model)
        reservation = Reservation(self, model, time.monotonic() + RESERVATION_SECONDS)
        self.reservations[reservation] = None
        return reservation

    def claim(self, reservation: Reservation) -> bool:
        """The request starts: its reserved slot is its own now (True), or it was lost (False:
        expired, released), and the request is admitted as any other."""
        if reservation not in self.reservations:
            return False
        del self.reservations[reservation]
        return True

    def release(self, reservation: Reservation) -> None:
        if reservation in self.reservations:
            del self.reservations[reservation]
            self.active[reservation.model] -= 1  # not a request finished: not in the drain rate
            self.total -= 1

    def _expire(self) -> None:
        now = time.monotonic()
        while self.reservations:
            oldest = next(iter(self.reservations))
            if oldest.expires > now:
                return
            self.release(oldest)


class FairPool:
    """A thread pool shared by weight between lanes (one per model): see the module's text."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int) -> None:
        self._pool = pool
        self._threads = threads
        self._running = 0
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []
        self._now = 0.0
        """Virtual time: the start tag of the task dispatched last."""

    def lane(self, share: float) -> Lane:
        lane = Lane(self, share)
        with self._lock:  # a reload adds lanes while the pool runs
            self._lanes.append(lane)
        return lane

    def drop(self, lane: Lane) -> None:
        """Remove a lane (its model removed by a reload, its requests answered); a task left in it
        is cancelled."""
        with self._lock:
            if lane in self._lanes:
                self._lanes.remove(lane)
            left = list(lane.tasks)
            lane.tasks.clear()
        for task in left:
            task.future.cancel()

    def _enqueue(self, lane: Lane, task: _Task) -> None:
        with self._lock:
            if not lane.tasks:
                lane.start = max(lane.start, self._now)
            lane.tasks.append(task)
            ready = self._take()
        self._run(ready)

    def _take(self) -> list[_Task]:
        """Under the lock: the tasks that may go to the pool now, in fair order."""
        ready = []
        while self._running < self._threads:
            waiting = [lane for lane in self._lanes if lane.tasks]
            if not waiting:
                break
            lane = min(waiting, key=lambda candidate: candidate.start)
            self._now = lane.start
            lane.start += 1.0 / lane.share
            ready.append(lane.tasks.popleft())
            self._running += 1
        return ready

    def _run(self, ready: list[_Task]) -> None:
        for i, task in enumerate(ready):
            try:
                self._pool.submit(self._call, task)
            except RuntimeError:  # the pool is shut down: these never run
                with self._lock:
                    self._running -= len(ready) - i
                for lost in ready[i:]:
                    lost.future.cancel()
                return

    def close(self) -> None:
        """Cancel what waits in the lanes (before the pool shuts down: nothing runs it after)."""
        with self._lock:
            waiting = [task for lane in self._lanes for task in lane.tasks]
            for lane in self._lanes:
                lane.tasks.clear()
        for task in waiting:
            task.future.cancel()

    def _call(self, task: _Task) -> None:
        try:
            task()
        finally:
            with self._lock:
                self._running -= 1
                ready = self._take()
            self._run(ready)


class _Task:
    __slots__ = ("args", "fn", "future", "kwargs")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.future: Future[Any] = Future()
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled while it waited in its lane (its request was cancelled)
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class Lane(Executor):
    """One model's way into a ``FairPool``: an ``Executor`` (``loop.run_in_executor`` takes it)."""

    def __init__(self, pool: FairPool, share: float) -> None:
        self._fair = pool
        self.share = share
        self.start = 0.0
        """Virtual start time of this lane's next task."""
        self.tasks: deque[_Task] = deque()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        task = _Task(fn, args, kwargs)
        self._fair._enqueue(self, task)
        return task.future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The shared pool is shut down by its owner, not by a lane."""
