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
import logging
import time
from collections.abc import Awaitable, Callable

from service.errors import Conflict, ModelNotLoaded
from service.metrics import Metrics
from service.models.store import model_path
from service.serving.served import Running, ServedVersion

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
        metrics.model_memory_budget.set(budget)

    @property
    def used(self) -> int:
        return sum(memory_of(served) for served in self.versions if served.running is not None)

    async def _fit(self, loaded: ServedVersion) -> None:
        """After a load whose memory was not known before it (no ``memory``, no model file yet):
        unload the least recently used idle versions until the budget holds again."""
        idle = sorted(
            (v for v in self.versions if v.running is not None and v.in_use == 0 and v is not loaded),
            key=lambda v: v.last_used,
        )
        while self.used > self.budget and idle:
            await self.unload(
                idle.pop(0), reason=f"least recently used: room for {loaded.model} version {loaded.version}"
            )

    async def acquire(self, served: ServedVersion, deadline: float | None) -> None:
        """Hold ``served`` loaded for a request (``release`` after): loaded now, or by ``deadline``."""
        if served.running is None and served.lazy:
            load = self._loads.get(id(served))
            if load is None:
                load = asyncio.create_task(self._load(served), name=f"load {served.model}/{served.version}")
                self._loads[id(served)] = load
                load.add_done_callback(lambda task: self._loads.pop(id(served), None))
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(load)  # a request that gives up does not stop the load
            except TimeoutError:
                raise ModelNotLoaded(
                    f"model {served.model!r} version {served.version} is loading; retry in a moment"
                ) from None
            if served.running is None:  # unloaded again between the load and this request's turn
                raise ModelNotLoaded(f"model {served.model!r} version {served.version} is not loaded; retry")
        served.in_use += 1
        served.last_used = time.monotonic()

    def release(self, served: ServedVersion) -> None:
        served.in_use -= 1
        served.last_used = time.monotonic()

    async def _load(self, served: ServedVersion) -> None:
        labels = (served.model, served.version)
        async with self._lock:  # one at a time: each load's memory is counted before the next
            if served.running is not None:
                return
            await self._make_room(served)
            started = time.perf_counter()
            try:
                served.running = await self._start(served)
            except Exception as exc:
                logger.warning("model %s version %s failed to load: %s", *labels, exc)
                self._metrics.model_loads.labels(*labels, "failed").inc()
                raise ModelNotLoaded(f"model {labels[0]!r} version {labels[1]} failed to load: {exc}") from exc
            seconds = time.perf_counter() - started
            served.last_used = time.monotonic()  # the least likely to make room for the next load
            await self._fit(served)
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

    async def _make_room(self, served: ServedVersion) -> None:
        need = memory_of(served)
        idle = sorted(
            (v for v in self.versions if v.running is not None and v.in_use == 0 and v is not served),
            key=lambda v: v.last_used,
        )
        free = self.budget - self.used
        evicted = []
        while free < need and idle:
            victim = idle.pop(0)
            evicted.append(victim)
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
        for victim in evicted:
            await self.unload(victim, reason=f"least recently used: room for {served.model} version {served.version}")

    async def unload_idle(self, served: ServedVersion) -> None:
        """Unload ``served`` now (an operator asks), unless a request uses it."""
        async with self._lock:
            if served.in_use:
                raise Conflict(
                    f"model {served.model!r} version {served.version} is in use by {served.in_use} request(s); "
                    "retry when they are answered"
                )
            await self.unload(served, reason="asked for")

    async def unload(self, served: ServedVersion, reason: str) -> None:
        running, served.running = served.running, None  # no request takes it from here on
        if running is None:
            return
        await self._stop(running)
        self._metrics.model_unloads.labels(served.model, served.version).inc()
        self._metrics.model_memory.labels(served.model, served.version).set(0)
        logger.info("model %s version %s unloaded (%s)", served.model, served.version, reason)
