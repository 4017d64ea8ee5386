"""Memory-bounded loading (GATEWAY_MODEL_MEMORY_BUDGET): the default model loads at start, the
others on first use; the least recently used idle version is unloaded to make room, a version in
use never is; a request that cannot be served in time gets 503 with Retry-After, and a load that
outlives its request finishes for the next one. Loads and unloads are counted."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


async def test_a_model_in_use_is_not_unloaded_and_the_request_that_needs_its_room_retries(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """a is busy (a 1.5 s batch): b cannot take its room, 503 with Retry-After; once a's request
    is answered, b loads in a's place."""
    models = _models(tmp_path, {"a": f"memory = {100 * MB}\nfake_delay = 1.5", "b": f"memory = {100 * MB}"})
    async with running_gateway(gateway_factory(models_file=models, model_memory_budget=150 * MB)) as client:
        busy = asyncio.create_task(client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG))
        async with asyncio.timeout(5):
            inflight = 'gateway_batcher_inflight_batches{model="a",version="1"} 1.0'
            while inflight not in (await client.get("/metrics")).text:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        refused = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "model_not_loaded"
        assert "the models in use hold 100 MB of the 150 MB budget" in refused.json()["detail"]
        assert refused.headers["retry-after"] == "5"
        assert (await busy).status_code == 200
        later = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
        assert later.status_code == 200
        assert await _loaded(client) == {"a": False, "b": True}


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
    both its requests are answered; c's load may not take b's room while b's requests wait for
    their turn, so c is refused (503, Retry-After) rather than b's requests after b's whole load."""
    models = _models(tmp_path, {name: f"memory = {100 * MB}" for name in ("a", "b", "c")})
    async with running_gateway(gateway_factory(models_file=models, model_memory_budget=150 * MB)) as client:
        answers = await asyncio.gather(
            *(client.post(f"/v1/models/{name}/classify", content=coffee_jpeg, headers=JPEG) for name in "bbcc")
        )
        assert [a.status_code for a in answers[:2]] == [200, 200], [a.text for a in answers]
        for refused in answers[2:]:
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "5"
        assert await _loaded(client) == {"a": False, "b": True, "c": False}
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
