"""Models added, removed or replaced in the models file take effect without a restart: an added
model answers, a removed one gets 404 while its requests in flight are answered, a declared
model's file replaced at the same path switches the answers with no request failing meanwhile, a
bad file changes nothing, and the default model cannot vanish unnoticed."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from service.http.gateway import Gateway
from service.serving.reload import reload_models
from service.settings import Settings
from tests.conftest import GatewayClient, running_gateway
from tests.models.exports import tiny_model

MakeSettings = Callable[..., Settings]
JPEG = {"content-type": "image/jpeg"}
LABELS = ["first", "second", "third", "fourth"]


def _fake(name: str, extra: str = "") -> str:
    return f"[models.{name}]\nprofile = 'trivial'\nbackend = 'fake'\n{extra}\n"


async def _reload(client: GatewayClient, path: Path) -> bool:
    await client.get("/v1/models")  # the server has started (its lifespan made the gateway)
    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    assert isinstance(gateway, Gateway)
    return await reload_models(path, gateway.models, gateway.settings, gateway.metrics)


def _declared_file(path: Path, *, reverse: bool = False) -> None:
    """A tiny ONNX model of 4 scores whose top label is the last (``reverse``: the first), written
    in place as a deploy would (a new file renamed over the old)."""
    model = tiny_model(["N", 3, 8, 8], outputs=len(LABELS))
    if reverse:
        for i, init in enumerate(model.graph.initializer):
            if init.name == "proj":
                weights = np.arange(len(LABELS), 0, -1, dtype=np.float32)[None]
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights, "proj"))
    fresh = path.with_suffix(".new")
    onnx.save(model, fresh)
    os.replace(fresh, path)


async def test_a_model_added_to_the_file_answers(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """A model the file gains is started and served (listed, answering) without a restart."""
    models = tmp_path / "models.toml"
    models.write_text(_fake("a"))
    async with running_gateway(gateway_factory(models_file=models)) as client:
        assert (await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)).status_code == 404
        models.write_text(_fake("a") + _fake("b"))
        assert await _reload(client, models)
        answer = await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"]["name"] == "b"
        listed = [m["name"] for m in (await client.get("/v1/models")).json()["models"]]
        assert listed == ["a", "b"]
        assert (await client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG)).status_code == 200


async def test_a_model_removed_gets_404_while_its_request_in_flight_is_answered(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """Removing a model: a new request for it gets 404 at once, the request it was answering (a
    1 s batch) is answered 200, and then its version stops."""
    models = tmp_path / "models.toml"
    models.write_text(_fake("b") + _fake("slow", "fake_delay = 1.0"))
    async with running_gateway(gateway_factory(models_file=models)) as client:
        await client.get("/v1/models")
        registry = client.app.state.gateway.models  # type: ignore[attr-defined]
        slow = registry.models["slow"].versions["1"]
        in_flight = asyncio.create_task(client.post("/v1/models/slow/classify", content=coffee_jpeg, headers=JPEG))
        async with asyncio.timeout(5):
            while not slow.held:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        models.write_text(_fake("b"))
        reload = asyncio.create_task(_reload(client, models))
        async with asyncio.timeout(5):
            while "slow" in registry.models:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        gone = await client.post("/v1/models/slow/classify", content=coffee_jpeg, headers=JPEG)
        assert gone.status_code == 404, gone.text
        assert "slow" in gone.text
        answered = await in_flight
        assert answered.status_code == 200, answered.text
        assert await reload
        assert slow.running is None
        assert slow.retired
        assert (await client.post("/v1/models/b/classify", content=coffee_jpeg, headers=JPEG)).status_code == 200


async def _top(client: GatewayClient, image: bytes) -> str:
    answer = await client.post("/v1/models/cars/classify", content=image, headers=JPEG)
    assert answer.status_code == 200, answer.text
    label: str = answer.json()["results"][0]["labels"][0]["label"]
    return label


def _cars(tmp_path: Path) -> Path:
    models = tmp_path / "models.toml"
    models.write_text(f"[models.cars]\npath = 'cars.onnx'\nlabels = {LABELS!r}\n")
    return models


async def test_a_declared_file_replaced_switches_the_answers_with_no_failed_request(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """The model's file replaced by another (same path, same declaration, other scores): the new
    one is loaded beside the old and the answers switch, while a client asking all along gets 200
    every time."""
    _declared_file(tmp_path / "cars.onnx")
    models = _cars(tmp_path)
    async with running_gateway(Settings(models_file=models, models_dir=tmp_path / "built")) as client:
        assert await _top(client, coffee_jpeg) == "fourth"
        statuses: list[int] = []
        labels: list[str] = []
        stop = asyncio.Event()

        async def ask() -> None:
            while not stop.is_set():
                answer = await client.post("/v1/models/cars/classify", content=coffee_jpeg, headers=JPEG)
                statuses.append(answer.status_code)
                if answer.status_code == 200:
                    labels.append(answer.json()["results"][0]["labels"][0]["label"])

        clients = [asyncio.create_task(ask()) for _ in range(4)]
        await asyncio.sleep(0.2)
        _declared_file(tmp_path / "cars.onnx", reverse=True)
        assert await _reload(client, models)
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*clients)
        assert await _top(client, coffee_jpeg) == "first"
    assert len(statuses) > 10
    assert set(statuses) == {200}, [s for s in statuses if s != 200][:5]
    assert labels[0] == "fourth"
    assert labels[-1] == "first"


async def test_a_bad_new_file_changes_nothing_and_a_good_one_after_it_applies(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated ONNX file is refused (counted ``refused``, the reason logged) and the running
    model answers as before; the next good file is applied."""
    _declared_file(tmp_path / "cars.onnx")
    models = _cars(tmp_path)
    async with running_gateway(Settings(models_file=models, models_dir=tmp_path / "built")) as client:
        await client.get("/v1/models")  # started on the good file
        good = (tmp_path / "cars.onnx").read_bytes()
        (tmp_path / "cars.onnx").write_bytes(good[: len(good) // 2])
        with caplog.at_level(logging.WARNING, "service.serving.reload"):
            assert not await _reload(client, models)
        assert "not applied (the running models stay)" in caplog.text
        assert "cars.onnx" in caplog.text
        assert 'gateway_model_reloads_total{outcome="refused"} 1.0' in (await client.get("/metrics")).text
        assert await _top(client, coffee_jpeg) == "fourth"
        _declared_file(tmp_path / "cars.onnx", reverse=True)
        assert await _reload(client, models)
        assert await _top(client, coffee_jpeg) == "first"
        assert 'gateway_model_reloads_total{outcome="applied"} 1.0' in (await client.get("/metrics")).text


async def test_the_default_model_or_every_model_removed_is_refused(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Dropping the default model without naming another is refused with the reason, as is a file
    with no model; naming the new default applies (the old default then gets 404)."""
    models = tmp_path / "models.toml"
    models.write_text(_fake("a") + _fake("b"))
    async with running_gateway(gateway_factory(models_file=models)) as client:
        models.write_text(_fake("b"))
        with caplog.at_level(logging.WARNING, "service.serving.reload"):
            assert not await _reload(client, models)
            assert "model 'a' is the default" in caplog.text
            assert 'default = "..."' in caplog.text
            models.write_text("")
            assert not await _reload(client, models)
            assert "no [models.NAME] table" in caplog.text
        assert (await client.post("/classify", content=coffee_jpeg, headers=JPEG)).json()["model"]["name"] == "a"
        models.write_text("default = 'b'\n" + _fake("b"))
        assert await _reload(client, models)
        assert (await client.post("/classify", content=coffee_jpeg, headers=JPEG)).json()["model"]["name"] == "b"
        assert (await client.post("/v1/models/a/classify", content=coffee_jpeg, headers=JPEG)).status_code == 404
