"""The one door to a served version (``ServedModels.check`` and ``hold``): admitted, then held loaded,
and both let go in reverse order whatever ends the request (an error, a cancellation while it waits
for the load, a refused load), so that no counter is left behind to keep a version from being drained
or a model's admission slot from being given back. Real loader, admission and fake backends."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.backends.fake import FakeBackend
from service.backends.health import BackendHealth
from service.errors import ModelNotLoaded, QueueFull
from service.metrics import Metrics
from service.serving.catalog import load_catalog
from service.serving.fair import Admission
from service.serving.loading import Loader
from service.serving.registry import ServedModels
from service.serving.served import Running, ServedModel, ServedVersion
from service.settings import Settings

MB = 1 << 20


@dataclasses.dataclass
class _Door:
    models: ServedModels
    a: ServedVersion
    b: ServedVersion
    gate: asyncio.Event
    """Loads wait while it is clear."""
    starting: asyncio.Event
    """Set when a load has begun."""

    def counted(self, served: ServedVersion) -> tuple[int, int, int]:
        """What holds ``served`` now: requests holding it, waiting for its load, and admitted."""
        return served.in_use, served.waiting, self.models.admission.active[served.model]


@asynccontextmanager
async def _door(tmp_path: Path, *, limit: int = 4, fail: str | None = None) -> AsyncIterator[_Door]:
    """Two lazy models, a and b (100 MB each, a 250 MB budget), none loaded, a loader whose loads
    wait for ``gate`` (the load of model ``fail`` fails), and admission of ``limit`` requests."""
    models_file = tmp_path / "models.toml"
    models_file.write_text("".join(f"[models.{name}]\nprofile = 'trivial'\nbackend = 'fake'\n" for name in "ab"))
    catalog = load_catalog(Settings(models_file=models_file, models_dir=tmp_path))
    metrics = Metrics(CollectorRegistry())
    gate, starting = asyncio.Event(), asyncio.Event()
    gate.set()

    async def start(served: ServedVersion) -> Running:
        starting.set()
        await gate.wait()
        if served.model == fail:
            raise RuntimeError("the runtime refused the model")
        health = BackendHealth(FakeBackend(), served.metrics, 1.0)
        await health.refresh()
        return Running(classifier=None, backend=health.backend, health=health, watcher=None)  # type: ignore[arg-type]

    async def stop(running: Running) -> None:
        pass

    with ThreadPoolExecutor(1) as pool:
        served: dict[str, ServedModel] = {}
        for spec in catalog.models:
            version = dataclasses.replace(spec.versions[0], memory=100 * MB)
            lazy = ServedVersion(spec.name, version, metrics.model(spec.name, "1", "fake"), pool, lazy=True)
            served[spec.name] = ServedModel(spec, {"1": lazy})
        every = [model.versions["1"] for model in served.values()]
        loader = Loader(250 * MB, every, start, stop, metrics)
        admission = Admission(limit, {name: 1.0 for name in served})
        door = _Door(ServedModels(catalog, served, admission, loader), *every, gate, starting)
        try:
            yield door
        finally:
            gate.set()
            await loader.aclose()


async def test_a_request_cancelled_while_it_waits_for_the_load_leaves_nothing_counted(tmp_path: Path) -> None:
    """A request waiting for its version's load is cancelled (its client left): it no longer counts
    as waiting nor admitted, it never held the version, and the load goes on for the next request."""
    async with _door(tmp_path) as door:
        door.gate.clear()
        entered = asyncio.Event()

        async def request() -> None:
            async with door.models.hold(door.a, None):
                entered.set()

        waiting = asyncio.create_task(request())
        await door.starting.wait()
        assert door.counted(door.a) == (0, 1, 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert door.counted(door.a) == (0, 0, 0)
        assert door.models.admission.total == 0
        assert not entered.is_set()
        door.gate.set()
        async with asyncio.timeout(5), door.models.hold(door.a, None) as held:  # the load went on
            assert held is door.a
            assert held.running is not None
            assert door.counted(door.a) == (1, 0, 1)
        assert door.counted(door.a) == (0, 0, 0)


async def test_a_request_cancelled_or_failing_while_it_holds_the_version_lets_go_of_it(tmp_path: Path) -> None:
    """The body of a hold raises, or is cancelled (a deadline, a client gone): the version is let go
    of (a drain waiting for it can go on) and the admission slot given back."""
    async with _door(tmp_path) as door:

        async def failing() -> None:
            async with door.models.hold(door.a, None):
                assert door.counted(door.a) == (1, 0, 1)
                raise ValueError("a bad batch")

        with pytest.raises(ValueError, match="a bad batch"):
            await failing()
        assert door.counted(door.a) == (0, 0, 0)
        inside = asyncio.Event()

        async def request() -> None:
            async with door.models.hold(door.a, None):
                inside.set()
                await asyncio.Event().wait()  # an inference that never ends

        holding = asyncio.create_task(request())
        await inside.wait()
        assert door.counted(door.a) == (1, 0, 1)
        holding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holding
        assert door.counted(door.a) == (0, 0, 0)
        assert door.models.admission.total == 0


async def test_a_refused_load_gives_the_admission_slot_back(tmp_path: Path) -> None:
    """A load that fails (and one that does not finish by the deadline) is refused with 503
    ``model_not_loaded``; the request is no longer admitted nor waiting."""
    async with _door(tmp_path, fail="b") as door:
        with pytest.raises(ModelNotLoaded, match="failed to load"):
            async with door.models.hold(door.b, None):
                pytest.fail("a version whose load failed was held")
        assert door.counted(door.b) == (0, 0, 0)
        door.gate.clear()
        deadline = asyncio.get_running_loop().time() + 0.05
        with pytest.raises(ModelNotLoaded, match="is loading"):
            async with door.models.hold(door.a, deadline):
                pytest.fail("a version was held before its load")
        assert door.counted(door.a) == (0, 0, 0)
        assert door.models.admission.total == 0


async def test_a_full_model_is_refused_before_its_version_is_loaded(tmp_path: Path) -> None:
    """With no room (one request admitted of one), ``check`` and ``hold`` refuse with 429 at once:
    nothing is loaded for the refused request, and the admitted one is not disturbed. The worker's
    and the operator's holds (``admit=False``) are not requests in progress: they take no slot."""
    async with _door(tmp_path, limit=1) as door:
        async with door.models.hold(door.a, None):
            with pytest.raises(QueueFull):
                door.models.check(door.b)
            with pytest.raises(QueueFull):
                async with door.models.hold(door.b, None):
                    pytest.fail("a request was admitted beyond the limit")
            assert door.counted(door.b) == (0, 0, 0)
            assert door.b.running is None  # not loaded for a request that was refused
            async with door.models.hold(door.b, None, admit=False) as held:
                assert held.running is not None
                assert door.counted(door.b) == (1, 0, 0)
            assert door.models.admission.total == 1
        assert door.models.admission.total == 0
