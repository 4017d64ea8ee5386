"""Every model served here, by name, and the one door to a served version: every entry point (the
image routes, the Open Inference Protocol, the queue worker, the admin load route, the start-up
loads) goes through ``ServedModels.check`` and ``ServedModels.hold`` instead of writing the
admission and loading sequence again.

A request first asks ``check`` (is there room now? 429 otherwise) before it spends anything (reading
a body, a quota); then, with no wait in between, ``hold`` admits it, holds the version loaded
(loading it within the deadline, under a memory budget) and, whatever happens inside (an error, a
cancelled request, a client gone), lets go of both in reverse order: a hand-written sequence that
missed one ``release`` on one path kept a version from ever being drained, or a model's admission
slot from ever being given back.

A reloaded models file changes the models here (``service.serving.changes``): a version it removes
or replaces is *retired*. A request that chose a retired version before the change is still served
by it while it runs (``hold`` counts it, and the version stops only once none holds it); one that
reaches ``hold`` after it stopped gets its replacement (``hold`` yields the version to use), or 404
when its model or version is gone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING

from service.errors import NotFound
from service.serving.catalog import Catalog
from service.serving.fair import Admission, Reservation
from service.serving.loading import Loader
from service.serving.served import ServedModel, ServedVersion, quoted

if TYPE_CHECKING:
    from service.serving.pipeline import Assembly


class ServedModels:
    """Every model served here, by name, with the default (``/classify``'s) and the fair admission."""

    def __init__(
        self,
        catalog: Catalog,
        models: dict[str, ServedModel],
        admission: Admission,
        loader: Loader | None = None,
        bodies: Admission | None = None,
    ) -> None:
        self.catalog = catalog
        self.models = models
        self.default = models[catalog.default]
        self.admission = admission
        """Requests in progress, shared by weight."""
        self.bodies = bodies
        """Bytes of the request bodies being received, shared by weight (``BodyLimitMiddleware``)."""
        self.loader = loader
        """Loads and unloads in-process versions within the memory budget (None: no budget, all loaded)."""
        self.assembly: Assembly | None = None
        """What starts the versions a reloaded models file adds (None: this registry cannot grow)."""
        self.on_added: list[Callable[[ServedVersion], None]] = []
        """Called for each version a reload adds, before any request can reach it (its answer renderer)."""
        self.on_removed: list[Callable[[ServedVersion], None]] = []
        """Called for each version a reload retired, once it has stopped."""

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"no model {quoted(name, 64, 'name')}; this gateway serves {', '.join(self.models)}")
        return model

    def versions(self) -> list[ServedVersion]:
        return [version for model in self.models.values() for version in model.versions.values()]

    def retarget(self, catalog: Catalog) -> None:
        """Apply a reloaded catalog's traffic weights and sticky flags (its models are these)."""
        for spec in catalog.models:
            self.models[spec.name].route(spec)
        shares = {spec.name: spec.share for spec in catalog.models}
        self.admission.reshare(shares)
        if self.bodies is not None:
            self.bodies.reshare(shares)
        self.catalog = catalog

    def current(self, served: ServedVersion) -> ServedVersion:
        """The version a request that chose ``served`` uses: ``served``, unless a reload retired it
        and it no longer runs (then its replacement; ``NotFound`` when its model or version is gone)."""
        if not served.retired or (served.running is not None and not served.stopping and not served.draining):
            return served
        model = self.models.get(served.model)
        if model is None:
            raise NotFound(f"model {served.model!r} was removed; this gateway serves {', '.join(self.models)}")
        return model.version(served.version)

    def check(self, served: ServedVersion, reserved: Reservation | None = None) -> None:
        """Refuse now (``QueueFull``, 429) when ``served``'s model has no room for one more request:
        before the request spends time or quota on what it could not run. A request admitted from
        its head (``reserved``, its slot still held) has its room."""
        model = self.current(served).model
        if reserved is not None and reserved.holds(model):
            return
        self.admission.check(model)

    def _enter(self, served: ServedVersion, reserved: Reservation | None) -> None:
        """Take a slot for a request of ``served``'s model: its reserved one, or a free one."""
        if reserved is not None and reserved.model == served.model and self.admission.claim(reserved):
            return
        self.check(served)
        self.admission.enter(served.model)

    @contextmanager
    def admitted(self, served: ServedVersion, reserved: Reservation | None = None) -> Iterator[None]:
        """A request of ``served``'s model in progress (refused as ``check`` refuses), without the
        version loaded: an offline submit, which only queues its images."""
        self._enter(served, reserved)
        try:
            yield
        finally:
            self.admission.leave(served.model)

    @asynccontextmanager
    async def hold(
        self, served: ServedVersion, deadline: float | None, *, admit: bool = True, reserved: Reservation | None = None
    ) -> AsyncIterator[ServedVersion]:
        """``served``, loaded, for the body of the ``async with``: admitted first (``admit``; the
        queue worker and the operator's loads are not requests in progress), then held by the
        memory budget's loader (loaded by ``deadline``, event-loop time, or ``ModelNotLoaded``; None:
        no limit). Both are let go in reverse order whatever ends the body, a cancellation included;
        a request cancelled while it waits for the load leaves nothing counted. The version to use is
        yielded: ``served``, or its replacement where a reload retired it (``current``). An admitted
        request is counted in the version's statistics, answered or failed, with its time here.
        ``reserved``: the slot taken for it from its head, if it still holds one."""
        served = self.current(served)
        served.held += 1
        served.idle.clear()
        started = time.perf_counter_ns()
        answered = False
        try:
            if admit:
                self._enter(served, reserved)
            try:
                loader = self.loader
                if loader is not None:
                    await loader.acquire(served, deadline)
                try:
                    yield served
                    answered = True
                finally:
                    if loader is not None:
                        loader.release(served)
            finally:
                if admit:
                    self.admission.leave(served.model)
        finally:
            served.held -= 1
            if not served.held:
                served.idle.set()
            if admit:  # a request (not the worker's job, nor a load): the protocol's statistics count it
                served.statistics.request(answered, time.perf_counter_ns() - started)
