"""Memory-bounded loading: with ``GATEWAY_MODEL_MEMORY_BUDGET``, in-process model versions load
on first use, and versions that do not fit in the budget together take turns in it.

A version's memory is what the models file says (``memory``, bytes) or else an estimate: twice its
model file (the weights, and as much again for the runtime's buffers). Loads run one at a time, so
each is counted before the next is decided. A load makes room by unloading the least recently used
idle versions (no request holds one or waits for it) and, when that is not enough, by draining busy
ones, the least recently loaded first: a draining version takes no new request (those wait for its
reload, as for a version not loaded) and is unloaded once the requests holding it are answered. A
version is drained only after ``MIN_RESIDENCY`` seconds loaded, so that two models under steady
traffic alternate in turns instead of thrashing; a drain that outlasts ``DRAIN_LIMIT`` is given up
(the version serves on, the load is refused: 503 ``model_not_loaded`` with ``Retry-After``).

A request for a version not loaded waits for the load (and its turn) within its deadline, or gets
503 ``model_not_loaded`` with ``Retry-After`` (the load goes on for the next request); a version
larger than the whole budget is refused at once. A request holding a version is never cut off.
Requests holding a version (``in_use``) and those waiting for its load (``waiting``) are counted
apart: a drain waits for the first only, since the second wait for the drained version's reload.
Triton's models are not counted: Triton holds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import NoReturn

from service.errors import Conflict, ModelNotLoaded, public_text
from service.metrics import Metrics
from service.models.store import model_bytes
from service.serving.served import FAILED_LOAD_BACKOFF, Running, ServedVersion

logger = logging.getLogger(__name__)

ESTIMATE_FACTOR = 2
"""Memory of a version without a declared ``memory``: this many times its model file."""

MIN_RESIDENCY = 5.0
"""Seconds a version stays loaded before it may be drained for another: its turn (models in steady
use alternate at this pace at most, instead of unloading each other at every request)."""

DRAIN_LIMIT = 15.0
"""Seconds a drain waits for the requests holding a version (longer than a request's default
deadline, 10 s) before it is given up: the version serves on, and the load that needed it is refused."""

REFUSED_RETRY_AFTER = 5
"""``Retry-After`` of a load refused now (a drain given up): seconds."""


def memory_of(served: ServedVersion) -> int:
    """A version's memory in the budget: declared, or ``ESTIMATE_FACTOR`` x its model file (0 until
    the file exists: it is built at the version's first load)."""
    if served.spec.memory is not None:
        return served.spec.memory
    try:
        return ESTIMATE_FACTOR * model_bytes(served.spec.settings.models_dir, served.spec.profile)
    except OSError:
        return 0


Start = Callable[[ServedVersion], Awaitable[Running]]
Stop = Callable[[Running], Awaitable[None]]


class Loader:
    """Loads the lazy versions on first use, one at a time, and unloads others (idle, or drained
    after their turn) to keep them within the memory budget."""

    def __init__(
        self,
        budget: int,
        versions: list[ServedVersion],
        start: Start,
        stop: Stop,
        metrics: Metrics,
        *,
        min_residency: float = MIN_RESIDENCY,
        drain_limit: float = DRAIN_LIMIT,
    ) -> None:
        self.budget = budget
        self.versions = versions
        """The lazy versions (in-process backends); others are loaded at start and not counted."""
        self.min_residency = min_residency
        """Seconds a version stays loaded before it may be drained for another (``MIN_RESIDENCY``)."""
        self.drain_limit = drain_limit
        """Seconds a drain waits for the requests holding a version (``DRAIN_LIMIT``)."""
        self._start = start
        self._stop = stop
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._loads: dict[int, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        """Set when a draining version's last request leaves, and at shutdown."""
        self._closed = False
        metrics.model_memory_budget.set(budget)

    @property
    def used(self) -> int:
        return sum(memory_of(served) for served in self.versions if served.running is not None)

    async def acquire(self, served: ServedVersion, deadline: float | None) -> None:
        """Hold ``served`` loaded for a request (``release`` after): loaded now, or by ``deadline``.

        A version not loaded, or draining (its turn is over), is waited for until its (re)load; the
        request counts in ``waiting`` meanwhile, not ``in_use``: a drain waits only for the requests
        holding the version, not for those waiting for its next turn."""
        while served.lazy and (served.running is None or served.draining):
            if (failure := served.failure) is not None:
                raise ModelNotLoaded(failure, retry_after=served.retry_in)
            load = self._loads.get(id(served))
            if load is None or load.done():
                # a context of its own: the request that triggers it leaves no ids on the version's tasks
                load = asyncio.create_task(
                    self._load(served), name=f"load {served.model}/{served.version}", context=contextvars.Context()
                )
                self._loads[id(served)] = load
                served.loading = True
                load.add_done_callback(partial(self._loaded, served))
            served.waiting += 1
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(load)  # a request that gives up does not stop the load
            except TimeoutError:
                raise ModelNotLoaded(
                    f"model {served.model!r} version {served.version} is loading (or waiting for its turn in the "
                    "memory budget); retry in a moment"
                ) from None
            finally:
                served.waiting -= 1
            # loaded; or drained again before this request's turn (then it waits for the next load)
        served.in_use += 1
        served.last_used = time.monotonic()

    def _loaded(self, served: ServedVersion, task: asyncio.Task[None]) -> None:
        if self._loads.get(id(served)) is task:
            del self._loads[id(served)]
            served.loading = False
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have given up; it is logged and counted

    def release(self, served: ServedVersion) -> None:
        served.in_use -= 1
        served.last_used = time.monotonic()
        if served.draining and served.in_use == 0:
            self._wake.set()

    async def _load(self, served: ServedVersion) -> None:
        labels = (served.model, served.version)
        async with self._lock:  # one at a time: each load's memory is counted before the next
            if served.running is not None:
                return
            if self._closed:
                raise ModelNotLoaded("the gateway is shutting down")
            await self._make_room(served)
            started = time.perf_counter()
            try:
                running = await self._start(served)
            except Exception as exc:
                failure = self._fail(served, f"failed to load: {public_text(exc)}", f"failed to load: {exc}")
                raise ModelNotLoaded(failure, retry_after=served.retry_in) from exc
            problem = running.health.problem
            if problem is not None:  # started, but cannot serve (a backend that keeps its error)
                await self._stop(running)
                failure = self._fail(served, f"cannot serve: {problem}")
                raise ModelNotLoaded(failure, retry_after=served.retry_in)
            served.running = running
            served.loaded_at = time.monotonic()
            served.failed = None
            seconds = time.perf_counter() - started
            await self._evict(
                self._over_budget(served), f"least recently used: room for {labels[0]} version {labels[1]}"
            )
        self._metrics.model_loads.labels(*labels, "loaded").inc()
        self._metrics.model_memory.labels(*labels).set(memory_of(served))
        logger.info(
            "model %s version %s loaded in %.2f s (%d MB; %d of %d MB of the budget in use)",
            *labels,
            seconds,
            memory_of(served) >> 20,
            self.used >> 20,
            self.budget >> 20,
        )

    def _fail(self, served: ServedVersion, why: str, logged: str | None = None) -> str:
        """Mark ``served`` failed (refused at once until a load is tried again); the message that says
        so (``why``; ``logged``, for the log only, may say more)."""
        logger.warning("model %s version %s %s", served.model, served.version, logged or why)
        self._metrics.model_loads.labels(served.model, served.version, "failed").inc()
        failure = f"model {served.model!r} version {served.version} {why} (tried again {FAILED_LOAD_BACKOFF:g} s after)"
        served.failed = (time.monotonic(), failure)
        return failure

    def _refuse(self, served: ServedVersion, reason: str) -> NoReturn:
        """Refuse this load of ``served`` (counted ``refused``); its requests are told to retry."""
        self._metrics.model_loads.labels(served.model, served.version, "refused").inc()
        raise ModelNotLoaded(
            f"model {served.model!r} version {served.version} cannot be loaded now: {reason}",
            retry_after=REFUSED_RETRY_AFTER,
        )

    def _idle(self, besides: ServedVersion) -> list[ServedVersion]:
        """Loaded versions no request holds or waits for, least recently used first."""
        return sorted(
            (v for v in self.versions if v.running is not None and not (v.in_use or v.waiting) and v is not besides),
            key=lambda v: v.last_used,
        )

    def _over_budget(self, loaded: ServedVersion) -> list[ServedVersion]:
        """After a load whose memory was not known before it (no ``memory``, no model file yet):
        the least recently used idle versions to unload for the budget to hold again."""
        excess, victims = self.used - self.budget, []
        for victim in self._idle(loaded):
            if excess <= 0:
                break
            victims.append(victim)
            excess -= memory_of(victim)
        return victims

    def _victims(self, served: ServedVersion, need: int) -> list[ServedVersion]:
        """The versions to unload for ``need`` bytes: the least recently used idle ones first, then
        the least recently loaded busy ones (every other version, if need be: ``need`` fits the budget)."""
        busy = sorted(
            (v for v in self.versions if v.running is not None and (v.in_use or v.waiting) and v is not served),
            key=lambda v: v.loaded_at,
        )
        free, victims = self.budget - self.used, []
        for victim in (*self._idle(served), *busy):
            if free >= need:
                break
            victims.append(victim)
            free += memory_of(victim)
        return victims

    async def _make_room(self, served: ServedVersion) -> None:
        """Unload what ``served`` needs the room of: idle versions at once, busy ones once their turn
        is over (``min_residency``) and the requests holding them are answered (``_drain``)."""
        need = memory_of(served)
        if need > self.budget:
            self._refuse(served, f"it needs {need >> 20} MB, more than the whole budget ({self.budget >> 20} MB)")
        while True:  # the busy victims' turns first: meanwhile they serve on, and the choice may change
            victims = self._victims(served, need)
            busy = [v for v in victims if v.in_use or v.waiting]
            turn_over = max((v.loaded_at for v in busy), default=0.0) + self.min_residency
            if not busy or time.monotonic() >= turn_over:
                break
            await self._pause(turn_over - time.monotonic())
        if busy:
            await self._drain(served, victims)
        await self._evict(victims, f"room for {served.model} version {served.version}")

    async def _drain(self, served: ServedVersion, victims: list[ServedVersion]) -> None:
        """Take ``victims`` from new requests (they wait for a reload) and wait, ``drain_limit`` at
        most, for the requests holding them to be answered. Given up (or at shutdown), the victims
        serve on and this load is refused."""
        for victim in victims:
            victim.draining = True
            if victim.in_use:
                logger.info(
                    "model %s version %s draining for %s version %s (%d request(s) hold it)",
                    victim.model,
                    victim.version,
                    served.model,
                    served.version,
                    victim.in_use,
                )
        try:
            until = time.monotonic() + self.drain_limit
            while holding := [v for v in victims if v.in_use]:
                if (left := until - time.monotonic()) <= 0:
                    shown = ", ".join(f"{v.model} version {v.version}" for v in holding)
                    self._refuse(
                        served, f"its room is held by {shown}, still in use after {self.drain_limit:g} s; retry"
                    )
                await self._pause(left)
        except BaseException:
            for victim in victims:
                victim.draining = False
            raise

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less: until a draining version's last request leaves (or shutdown,
        which refuses the load)."""
        if not self._closed:
            self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        if self._closed:
            raise ModelNotLoaded("the gateway is shutting down")

    async def _evict(self, victims: list[ServedVersion], why: str) -> None:
        """Unload ``victims``: all taken from requests at once, before the first is stopped (no
        request can take one while another drains)."""
        taken = [(victim, victim.running) for victim in victims]
        for victim in victims:
            victim.running, victim.draining = None, False
        for victim, running in taken:
            if running is not None:
                await self._finish(victim, running, why)

    async def unload_idle(self, served: ServedVersion) -> None:
        """Unload ``served`` now (an operator asks), unless a request holds it or waits for it."""
        async with self._lock:
            if requests := served.in_use + served.waiting:
                raise Conflict(
                    f"model {served.model!r} version {served.version} is in use by {requests} request(s); "
                    "retry when they are answered"
                )
            running, served.running = served.running, None
            if running is not None:
                await self._finish(served, running, "asked for")

    async def _finish(self, served: ServedVersion, running: Running, why: str) -> None:
        await self._stop(running)
        self._metrics.model_unloads.labels(served.model, served.version).inc()
        self._metrics.model_memory.labels(served.model, served.version).set(0)
        logger.info("model %s version %s unloaded (%s)", served.model, served.version, why)

    async def aclose(self) -> None:
        """At shutdown: no load starts from here on, a load waiting for room gives up (what it drained
        serves on), and the loads under way finish (or are cancelled after a minute), so that what
        they started is stopped with the rest."""
        self._closed = True
        self._wake.set()
        loads = list(self._loads.values())
        if loads:
            _, pending = await asyncio.wait(loads, timeout=60)
            for load in pending:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
