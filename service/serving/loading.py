"""Memory-bounded loading: with ``GATEWAY_MODEL_MEMORY_BUDGET``, in-process model versions load
on first use, and the least recently used idle one is unloaded when a load would exceed the budget.

A version's memory is what the models file says (``memory``, bytes) or else an estimate: twice its
model file (the weights, and as much again for the runtime's buffers). Loads run one at a time, so
each is counted before the next is decided. A request for a version not loaded waits for the load
within its deadline, or gets 503 ``model_not_loaded`` with ``Retry-After`` (the load goes on); a
version whose memory cannot be freed (the others are in use) is refused the same way. A version in
use (a request holds it) is never unloaded. Triton's models are not counted: Triton holds them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from service.errors import Conflict, ModelNotLoaded, public_text
from service.metrics import Metrics
from service.models.store import model_path
from service.serving.served import FAILED_LOAD_BACKOFF, Running, ServedVersion

logger = logging.getLogger(__name__)

ESTIMATE_FACTOR = 2
"""Memory of a version without a declared ``memory``: this many times its model file."""


def memory_of(served: ServedVersion) -> int:
    """A version's memory in the budget: declared, or ``ESTIMATE_FACTOR`` x its model file (0 until
    the file exists: it is built at the version's first load)."""
    if served.spec.memory is not None:
        return served.spec.memory
    try:
        return ESTIMATE_FACTOR * model_path(served.spec.settings.models_dir, served.spec.profile).stat().st_size
    except OSError:
        return 0


Start = Callable[[ServedVersion], Awaitable[Running]]
Stop = Callable[[Running], Awaitable[None]]


class Loader:
    def __init__(self, budget: int, versions: list[ServedVersion], start: Start, stop: Stop, metrics: Metrics) -> None:
        self.budget = budget
        self.versions = versions
        """The lazy versions (in-process backends); others are loaded at start and not counted."""
        self._start = start
        self._stop = stop
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._loads: dict[int, asyncio.Task[None]] = {}
        self._closed = False
        metrics.model_memory_budget.set(budget)

    @property
    def used(self) -> int:
        return sum(memory_of(served) for served in self.versions if served.running is not None)

    async def acquire(self, served: ServedVersion, deadline: float | None) -> None:
        """Hold ``served`` loaded for a request (``release`` after): loaded now, or by ``deadline``.

        A request waiting for a load counts as using the version already, so that nothing unloads
        it between the load and the request's turn."""
        if served.running is not None or not served.lazy:
            served.in_use += 1
            served.last_used = time.monotonic()
            return
        if (failure := served.failure) is not None:
            raise ModelNotLoaded(failure, retry_after=served.retry_in)
        load = self._loads.get(id(served))
        if load is None:
            # a context of its own: the request that triggers it leaves no ids on the version's tasks
            load = asyncio.create_task(
                self._load(served), name=f"load {served.model}/{served.version}", context=contextvars.Context()
            )
            self._loads[id(served)] = load
            served.loading = True
            load.add_done_callback(partial(self._loaded, served))
        served.in_use += 1
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(load)  # a request that gives up does not stop the load
            if served.running is None:
                raise ModelNotLoaded(f"model {served.model!r} version {served.version} is not loaded; retry")
        except TimeoutError:
            served.in_use -= 1
            raise ModelNotLoaded(
                f"model {served.model!r} version {served.version} is loading; retry in a moment"
            ) from None
        except BaseException:  # its error, or the request cancelled (its client left)
            served.in_use -= 1
            raise
        served.last_used = time.monotonic()

    def _loaded(self, served: ServedVersion, task: asyncio.Task[None]) -> None:
        self._loads.pop(id(served), None)
        served.loading = False
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have given up; it is logged and counted

    def release(self, served: ServedVersion) -> None:
        served.in_use -= 1
        served.last_used = time.monotonic()

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
            served.failed = None
            seconds = time.perf_counter() - started
            await self._evict(self._over_budget(served), f"room for {labels[0]} version {labels[1]}")
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

    def _idle(self, besides: ServedVersion) -> list[ServedVersion]:
        """Loaded versions no request uses or waits for, least recently used first."""
        return sorted(
            (v for v in self.versions if v.running is not None and v.in_use == 0 and v is not besides),
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

    async def _make_room(self, served: ServedVersion) -> None:
        need = memory_of(served)
        free, victims = self.budget - self.used, []
        for victim in self._idle(served):
            if free >= need:
                break
            victims.append(victim)
            free += memory_of(victim)
        if free < need:
            self._metrics.model_loads.labels(served.model, served.version, "refused").inc()
            reason = (
                f"it needs {need >> 20} MB, more than the whole budget ({self.budget >> 20} MB)"
                if need > self.budget
                else f"it needs {need >> 20} MB and the models in use hold {(self.budget - free) >> 20} MB "
                f"of the {self.budget >> 20} MB budget"
            )
            raise ModelNotLoaded(
                f"model {served.model!r} version {served.version} cannot be loaded now: {reason}", retry_after=5
            )
        await self._evict(victims, f"room for {served.model} version {served.version}")

    async def _evict(self, victims: list[ServedVersion], why: str) -> None:
        """Unload ``victims``: all taken from requests at once, before the first is stopped (no
        request can take one while another drains)."""
        taken = [(victim, victim.running) for victim in victims]
        for victim in victims:
            victim.running = None
        for victim, running in taken:
            if running is not None:
                await self._finish(victim, running, f"least recently used: {why}")

    async def unload_idle(self, served: ServedVersion) -> None:
        """Unload ``served`` now (an operator asks), unless a request uses it."""
        async with self._lock:
            if served.in_use:
                raise Conflict(
                    f"model {served.model!r} version {served.version} is in use by {served.in_use} request(s); "
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
        """At shutdown: no load starts from here on, and the loads under way finish (or are cancelled
        after a minute), so that what they started is stopped with the rest."""
        self._closed = True
        loads = list(self._loads.values())
        if loads:
            _, pending = await asyncio.wait(loads, timeout=60)
            for load in pending:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
