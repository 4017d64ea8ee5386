"""Memory-bounded loading (GATEWAY_MODEL_MEMORY_BUDGET): the default model loads at start, the
others on first use; the least recently used idle version is unloaded to make room, a version in
use never is; a request that cannot be served in time gets 503 with Retry-After, and a load that
outlives its request finishes for the next one. Loads and unloads are counted."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.backends.fake import FakeBackend
from service.backends.health import BackendHealth
from service.errors import ModelNotLoaded
from service.metrics import Metrics
from service.schemas import VersionState
from service.serving.catalog import load_catalog
from service.serving.loading import Loader
from service.serving.pipeline import open_models
from service.serving.served import FAILED_LOAD_BACKOFF, Running, ServedVersion
from service.settings import Settings
from tests.conftest import GatewayClient, running_gateway

MakeSettings = Callable[..., Settings]
MB = 1 << 20
JPEG = {"content-type": "image/jpeg"}


def _models(tmp_path: Path, entries: dict[str, str]) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(
        "".join(f"[models.{name}]\nprofile = 'trivial'\nbackend = 'fake'\n{extra}\n" for name, extra in entries.items())
    )
    return path


async def _loaded(client: GatewayClient) -> dict[str, bool]:
    models = (await client.get("/v1/models")).json()["models"]
    return {m["name"]: m["versions"][0]["loaded"] for m in models}


def _counts(text: str, metric: str) -> dict[str, float]:
    pattern = rf'^{metric}\{{model="([^"]+)",(?:outcome="loaded",)?version="1"\}} (\S+)$'
    return {model: float(value) for model, value in re.findall(pattern, text, re.M)}


async def test_the_least_recently_used_idle_model_makes_room(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    models = _models(tmp_path, {name: f"memory = {100 * MB}" for name in ("a", "b", "c")})
    async with running_gateway(gateway_factory(models_file=models, model_memory_budget=250 * MB)) as client:
        assert await _loaded(client) == {"a": True, "b": False, "c": False}
        assert (await client.get("/readyz")).json()["checks"][
            "backend b/1"
        ] == "fake: not loaded (loads on first use): ok"
        for name in ("b", "a", "c"):  # c needs room: b is the least recently used
            answer = await client.post(f"/v1/models/{name}/classify", content=coffee_jpeg, headers=JPEG)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"]["name"] == name
        assert await _loaded(client) == {"a": True, "b": False, "c": True}
        text = (await client.get("/metrics")).text
    assert _counts(text, "gateway_model_loads_total") == {"a": 1.0, "b": 1.0, "c": 1.0}
    assert _counts(text, "gateway_model_unloads_total") == {"b": 1.0}
    assert _counts(text, "gateway_model_memory_bytes") == {"a": 100 * MB, "b": 0, "c": 100 * MB}


async def test_a_busy_model_is_drained_for_another_and_a_request_in_a_hurry_retries(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """a is busy (a 1.5 s batch) and b does not fit beside it: b's load drains a. A request for b
    whose deadline (0.3 s) is shorter than the drain gets 503 with Retry-After, and the load goes
    on; one with a longer deadline waits for its turn and is answered. a's request is answered,
    not cut off; a request for a while it drains waits for its reload, after b's turn."""
    models = _models(tmp_path, {"a": f"memory = {100 * MB}\nfake_delay = 1.5", "b": f"memory = {100 * MB}"})
    settings = gateway_factory(models_file=models, model_memory_budget=150 * MB)
    async with running_gateway(settings) as client:
        assert await _loaded(client) == {"a": True, "b": False}
        gateway = client.app.state.gateway
        gateway.models.loader.min_residency = 0.2
        busy = asyncio.create_task(client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG))
        async with asyncio.timeout(5):
            inflight = 'gateway_batcher_inflight_batches{model="a",version="1"} 1.0'
            while inflight not in (await client.get("/metrics")).text:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        gateway.settings = settings.model_copy(update={"request_timeout": 0.3})
        hurried = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
        assert hurried.status_code == 503, hurried.text
        assert hurried.json()["error"] == "model_not_loaded"
        assert "is loading (or waiting for its turn in the memory budget)" in hurried.json()["detail"]
        assert hurried.headers["retry-after"] == "1"
        gateway.settings = settings
        assert await _loaded(client) == {"a": True, "b": False}  # draining: its request is not cut off
        joining = asyncio.create_task(client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG))
        patient = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
        assert patient.status_code == 200, patient.text
        assert patient.json()["model"]["name"] == "b"
        assert (await busy).status_code == 200
        assert (await joining).status_code == 200  # a's reload, once b's turn was over
        assert await _loaded(client) == {"a": True, "b": False}
        text = (await client.get("/metrics")).text
    assert _counts(text, "gateway_model_loads_total") == {"a": 2.0, "b": 1.0}
    assert _counts(text, "gateway_model_unloads_total") == {"a": 1.0, "b": 1.0}


async def test_real_models_load_on_first_use_and_a_slow_load_finishes_for_the_next_request(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """EfficientNet-Lite0 and the trivial model, in ONNX Runtime, one at a time in the budget: a
    request whose deadline (1 ms) is shorter than the model's load gets 503, the load goes on,
    and a later request is answered by the loaded model."""
    models = tmp_path / "models.toml"
    models.write_text(
        f"default = 'small'\n[models.small]\nprofile = 'trivial'\nmemory = {60 * MB}\n"
        f"[models.real]\nprofile = 'efficientnet-lite0'\nmemory = {60 * MB}\n"
    )
    settings = gateway_factory(models_file=models, model_memory_budget=100 * MB, request_timeout=0.001)
    async with running_gateway(settings) as client:
        first = await client.post("/v1/models/real/classify", content=coffee_jpeg, headers=JPEG)
        assert first.status_code == 503, first.text
        assert first.json()["error"] == "model_not_loaded"
        assert "is loading" in first.json()["detail"]
        async with asyncio.timeout(30):
            while not (await _loaded(client))["real"]:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert await _loaded(client) == {"small": False, "real": True}
        client.app.state.gateway.settings = settings.model_copy(update={"request_timeout": 10.0})
        answer = await client.post("/v1/models/real/classify", content=coffee_jpeg, headers=JPEG)
        assert answer.json()["results"][0]["labels"][0]["label"] == "espresso"


async def test_the_operator_loads_and_unloads_in_process_models_with_the_admin_key(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    models = _models(tmp_path, {"a": f"memory = {100 * MB}", "b": f"memory = {100 * MB}"})
    admin = {"x-admin-key": "an-admin-key-for-the-test"}
    settings = gateway_factory(models_file=models, model_memory_budget=250 * MB, admin_key=admin["x-admin-key"])
    async with running_gateway(settings) as client:
        loaded = await client.post("/v1/models/b/load", headers=admin)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["versions"][0]["loaded"] is True
        unloaded = await client.post("/v1/models/a/unload", headers=admin)
        assert unloaded.json()["versions"][0]["loaded"] is False
        assert await _loaded(client) == {"a": False, "b": True}
        assert (await client.post("/v1/models/a/unload")).status_code == 403
    eager = gateway_factory(models_file=models, admin_key=admin["x-admin-key"])
    async with running_gateway(eager) as client:
        refused = await client.post("/v1/models/a/unload", headers=admin)
        assert refused.status_code == 409
        assert "loads and unloads only under GATEWAY_MODEL_MEMORY_BUDGET" in refused.json()["detail"]
    async with running_gateway(gateway_factory(models_file=models)) as client:
        off = await client.post("/v1/models/a/unload", headers=admin)
        assert off.status_code == 404
        assert "admin routes are off" in off.json()["detail"]


async def test_requests_waiting_for_a_load_keep_it_from_the_next_load(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """Two requests for b and two for c at once, room for one of them: b loads (a makes room) and
    both its requests are answered: c's load may not take b's room before b's turn is over (1 s
    here), though b's requests still wait to be woken when c's load looks for room. c's requests,
    whose deadline (0.5 s) is shorter than b's turn, get 503 with Retry-After; c's load goes on,
    and c answers the next request."""
    models = _models(tmp_path, {name: f"memory = {100 * MB}" for name in ("a", "b", "c")})
    settings = gateway_factory(models_file=models, model_memory_budget=150 * MB, request_timeout=0.5)
    async with running_gateway(settings) as client:
        assert await _loaded(client) == {"a": True, "b": False, "c": False}
        client.app.state.gateway.models.loader.min_residency = 1.0
        answers = await asyncio.gather(
            *(client.post(f"/v1/models/{name}/classify", content=coffee_jpeg, headers=JPEG) for name in "bbcc")
        )
        assert [a.status_code for a in answers[:2]] == [200, 200], [a.text for a in answers]
        for refused in answers[2:]:
            assert refused.status_code == 503
            assert "is loading" in refused.json()["detail"]
            assert refused.headers["retry-after"] == "1"
        async with asyncio.timeout(5):
            while not (await _loaded(client))["c"]:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert await _loaded(client) == {"a": False, "b": False, "c": True}
        assert (await client.post("/v1/models/c/classify", content=coffee_jpeg, headers=JPEG)).status_code == 200


async def test_a_versions_state_follows_its_load(tmp_path: Path) -> None:
    """A lazy version is ``unloaded`` until its first request, ``loading`` while its load runs (the
    request waits), ``ready`` once loaded; one whose load fails is ``failed`` with the error in its
    own ``reason`` (the waiting request is told to retry when a load is tried again, 30 s, not 1 s),
    and ``unloaded`` again once that time has passed. States are the fixed set, never error text."""
    settings = Settings(model="trivial", backend="fake", models_dir=tmp_path)
    spec = load_catalog(settings).models[0].versions[0]
    metrics = Metrics(CollectorRegistry())
    started, go = asyncio.Event(), asyncio.Event()

    async def start(served: ServedVersion) -> Running:
        started.set()
        await go.wait()
        if served.model == "bad":
            raise RuntimeError("its weights file is not one")
        health = BackendHealth(FakeBackend(), served.metrics, 1.0)
        await health.refresh()
        return Running(classifier=None, backend=health.backend, health=health, watcher=None)  # type: ignore[arg-type]

    async def stop(running: Running) -> None:
        pass

    with ThreadPoolExecutor(1) as pool:
        good, bad = (
            ServedVersion(name, spec, metrics.model(name, "1", "fake"), pool, lazy=True) for name in ("good", "bad")
        )
        loader = Loader(100 * MB, [good, bad], start, stop, metrics)
        assert (good.state, good.loaded, good.problem) == ((VersionState.UNLOADED, None), False, None)
        waiting = asyncio.create_task(loader.acquire(good, None))
        await started.wait()
        assert (good.state, good.loaded) == ((VersionState.LOADING, None), False)
        go.set()
        await waiting
        loader.release(good)
        assert (good.state, good.loaded) == ((VersionState.READY, None), True)

        with pytest.raises(ModelNotLoaded) as refused:
            await loader.acquire(bad, None)
        assert refused.value.headers == {"Retry-After": str(int(FAILED_LOAD_BACKOFF))}
        state, reason = bad.state
        assert (state, bad.loaded) == (VersionState.FAILED, False)
        assert "failed to load: RuntimeError" in str(reason)  # its text (a path, maybe) is for the log only
        assert bad.failed is not None
        bad.failed = (time.monotonic() - FAILED_LOAD_BACKOFF - 1, bad.failed[1])  # its backoff is over
        assert bad.state == (VersionState.UNLOADED, None)


async def test_a_failed_load_is_refused_for_the_time_it_says(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """A real gateway with a version whose load fails (its weights file is not one): the request
    that waited for the load gets 503 ``model_not_loaded`` with ``Retry-After: 30``, the time until a
    load is tried again (it said 1 while the version was refused for 30 s); a request a moment later
    gets the time that is left; ``GET /v1/models`` says ``failed``, the error in ``reason``."""
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    models = tmp_path / "models.toml"
    models.write_text(
        f"default = 'small'\n[models.small]\nprofile = 'trivial'\nbackend = 'fake'\nmemory = {MB}\n"
        f"[models.bad]\nprofile = 'resnet50'\nmodel_weights = '{junk}'\nmemory = {MB}\n"
    )
    async with running_gateway(gateway_factory(models_file=models, model_memory_budget=10 * MB)) as client:
        before = (await client.get("/v1/models/bad")).json()["versions"][0]
        assert (before["state"], before["loaded"], before["reason"]) == ("unloaded", False, None)
        first = await client.post("/v1/models/bad/classify", content=coffee_jpeg, headers=JPEG)
        assert first.status_code == 503, first.text
        assert first.json()["error"] == "model_not_loaded"
        assert "failed to load" in first.json()["detail"]
        assert first.headers["retry-after"] == "30"
        failed_at = time.monotonic()
        await asyncio.sleep(1.2)
        again = await client.post("/v1/models/bad/classify", content=coffee_jpeg, headers=JPEG)
        assert again.status_code == 503
        left = FAILED_LOAD_BACKOFF - (time.monotonic() - failed_at)
        assert left <= int(again.headers["retry-after"]) <= 29
        after = (await client.get("/v1/models/bad")).json()["versions"][0]
        assert (after["state"], after["loaded"], after["ready"]) == ("failed", False, False)
        assert "failed to load" in after["reason"]


async def test_two_models_that_do_not_fit_together_take_turns_under_steady_traffic(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """a is never idle (three overlapping loops of 0.1 s batches) and b does not fit beside it: b's
    24 requests over 3 s are answered (a is drained for b, then b for a), not refused for ever,
    and a's requests go on being answered between b's turns."""
    models = _models(tmp_path, {"a": f"memory = {100 * MB}\nfake_delay = 0.1", "b": f"memory = {100 * MB}"})
    async with running_gateway(gateway_factory(models_file=models, model_memory_budget=150 * MB)) as client:
        assert await _loaded(client) == {"a": True, "b": False}  # (the lifespan has run)
        client.app.state.gateway.models.loader.min_residency = 0.2  # turns of 0.2 s, not seconds
        stop = asyncio.Event()
        a_answers: list[tuple[float, int]] = []

        async def steady() -> None:
            while not stop.is_set():
                answer = await client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG)
                a_answers.append((time.monotonic(), answer.status_code))

        async def b_request(at: float) -> tuple[float, int, str]:
            await asyncio.sleep(at)
            answer = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
            return time.monotonic(), answer.status_code, answer.text

        loops = [asyncio.create_task(steady()) for _ in range(3)]
        await asyncio.sleep(0.3)  # a is busy from here on
        b_answers = await asyncio.gather(*(b_request(i * 0.125) for i in range(24)))
        stop.set()
        await asyncio.gather(*loops)
        text = (await client.get("/metrics")).text
    assert [status for _, status, _ in b_answers] == [200] * 24, [body for _, _, body in b_answers]
    assert all(status == 200 for _, status in a_answers), a_answers
    first_b, last_b = min(at for at, _, _ in b_answers), max(at for at, _, _ in b_answers)
    assert any(first_b < at < last_b for at, _ in a_answers)  # a had turns between b's
    loads, unloads = _counts(text, "gateway_model_loads_total"), _counts(text, "gateway_model_unloads_total")
    assert loads["a"] >= 2, loads  # loaded at start, and again after b's turn
    assert loads["b"] >= 1, loads
    assert unloads["a"] >= 1, unloads


class _Versions:
    """Lazy versions of 100 MB each (fake backends) and their loader, without a gateway: what starts
    and stops is logged, and a start waits while ``gate`` is clear."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.starting = asyncio.Event()
        self.metrics = Metrics(CollectorRegistry())
        self._names: dict[int, str] = {}

    async def start(self, served: ServedVersion) -> Running:
        self.log.append(f"start {served.model}")
        self.starting.set()
        await self.gate.wait()
        health = BackendHealth(FakeBackend(), served.metrics, 1.0)
        await health.refresh()
        self._names[id(health.backend)] = served.model
        return Running(classifier=None, backend=health.backend, health=health, watcher=None)  # type: ignore[arg-type]

    async def stop(self, running: Running) -> None:
        self.log.append(f"stop {self._names[id(running.backend)]}")

    @contextmanager
    def loader(self, tmp_path: Path, names: str, **timing: float) -> Iterator[tuple[Loader, list[ServedVersion]]]:
        """A loader of ``names`` (one version each) with room for one of them."""
        spec = load_catalog(Settings(model="trivial", backend="fake", models_dir=tmp_path)).models[0].versions[0]
        spec = dataclasses.replace(spec, memory=100 * MB)
        with ThreadPoolExecutor(1) as pool:
            versions = [
                ServedVersion(name, spec, self.metrics.model(name, "1", "fake"), pool, lazy=True) for name in names
            ]
            yield Loader(150 * MB, versions, self.start, self.stop, self.metrics, **timing), versions

    def refused(self, name: str) -> float | None:
        labels = {"model": name, "version": "1", "outcome": "refused"}
        return self.metrics.registry.get_sample_value("gateway_model_loads_total", labels)


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():  # noqa: ASYNC110 (a loader's state, set without an event to wait on)
            await asyncio.sleep(0.005)


async def test_a_version_just_loaded_is_not_drained_before_its_waiting_requests_hold_it(tmp_path: Path) -> None:
    """b's two requests wait for its load and c's load (room for one of them) is queued right behind
    it, so that c's load looks for room before b's requests are woken: b is not taken from them
    (they count as waiting, and b's turn has just begun). b is loaded once and both its requests
    hold it; c's request, whose deadline (0.1 s) is shorter than b's turn (0.3 s), is refused with
    Retry-After, and c's load goes on: it drains b once b's turn is over (a new request for b then
    waits for b's reload) and takes b's room once b's requests are answered."""
    versions = _Versions()
    versions.gate.clear()
    with versions.loader(tmp_path, "bc", min_residency=0.3) as (loader, (b, c)):
        b_requests = [asyncio.create_task(loader.acquire(b, None)) for _ in range(2)]
        await versions.starting.wait()  # b's load holds the lock
        deadline = asyncio.get_running_loop().time() + 0.1
        c_request = asyncio.create_task(loader.acquire(c, deadline))
        await _until(lambda: c.waiting == 1)
        await asyncio.sleep(0.01)  # c's load waits for the lock
        versions.gate.set()
        await asyncio.gather(*b_requests)
        assert (b.in_use, versions.log) == (2, ["start b"])
        with pytest.raises(ModelNotLoaded) as refused:
            await c_request
        assert "is loading (or waiting for its turn" in refused.value.detail
        assert refused.value.headers == {"Retry-After": "1"}
        await _until(lambda: b.draining)  # b's turn is over: c's load drains it
        late = asyncio.create_task(loader.acquire(b, None))  # waits for b's reload, does not join it
        await _until(lambda: b.waiting == 1)
        assert b.in_use == 2
        loader.release(b)
        loader.release(b)
        await late  # c (idle: its request gave up) makes room for b again
        assert versions.log == ["start b", "stop b", "start c", "stop c", "start b"]
        await loader.aclose()


async def test_a_drain_that_outlasts_its_limit_is_given_up_and_the_load_refused(tmp_path: Path) -> None:
    """a is held by a request that does not end: b's load drains a, meanwhile a new request for a
    waits for a's reload instead of joining it; after ``drain_limit`` (0.2 s) the drain is given up:
    b's request gets 503 with Retry-After 5 (counted refused), a serves on (the waiting request
    holds it) and nothing was unloaded."""
    versions = _Versions()
    with versions.loader(tmp_path, "ab", min_residency=0.0, drain_limit=0.2) as (loader, (a, b)):
        await loader.acquire(a, None)
        b_request = asyncio.create_task(loader.acquire(b, None))
        await _until(lambda: a.draining)
        a_request = asyncio.create_task(loader.acquire(a, None))
        await _until(lambda: a.waiting == 1)
        assert a.in_use == 1
        with pytest.raises(ModelNotLoaded) as refused:
            await b_request
        assert "its room is held by a version 1, still in use after 0.2 s" in refused.value.detail
        assert refused.value.headers == {"Retry-After": "5"}
        assert versions.refused("b") == 1
        async with asyncio.timeout(2):
            await a_request
        assert (a.in_use, a.waiting, a.draining, a.running is not None) == (2, 0, False, True)
        assert versions.log == ["start a"]
        await loader.aclose()


async def test_shutdown_gives_up_a_drain_at_once(tmp_path: Path) -> None:
    """At shutdown, a load draining a busy version (for up to 30 s) gives up at once: its request is
    told the gateway is shutting down, and the drained version is left as it was, to be stopped
    with the rest."""
    versions = _Versions()
    with versions.loader(tmp_path, "ab", min_residency=0.0, drain_limit=30.0) as (loader, (a, b)):
        await loader.acquire(a, None)
        b_request = asyncio.create_task(loader.acquire(b, None))
        await _until(lambda: a.draining)
        async with asyncio.timeout(2):
            await loader.aclose()
        with pytest.raises(ModelNotLoaded, match="shutting down"):
            await b_request
        assert (a.draining, a.running is not None, versions.log) == (False, True, ["start a"])


class _StartFails(FakeBackend):
    """A backend whose start fails after it has opened something: ``closed`` says whether that was released."""

    async def start(self) -> None:
        self.started = True
        raise RuntimeError("the runtime refused the model")


async def test_a_backend_whose_start_fails_is_closed(gateway_factory: MakeSettings) -> None:
    """The lone model, loaded on first use under a budget, with a backend whose start raises: the
    load fails (the version says so, counted ``failed``) and the backend is closed, not left holding
    what its start opened (threads, connections) for the life of the process."""
    backend = _StartFails()
    metrics = Metrics(CollectorRegistry())
    settings = gateway_factory(model="trivial", backend="fake", model_memory_budget=1 << 30)
    async with open_models(settings, metrics, backend=backend) as models:
        served = models.default.versions["1"]
        assert served.lazy
        assert served.state[0] is VersionState.FAILED
        assert "failed to load: RuntimeError" in str(served.state[1])
        assert backend.started
        assert backend.closed
        labels = {"model": served.model, "version": "1", "outcome": "failed"}
        assert metrics.registry.get_sample_value("gateway_model_loads_total", labels) == 1
