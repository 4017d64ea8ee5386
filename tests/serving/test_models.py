"""Several models behind one gateway: each answers by name and version, on real models (embedded
EfficientNet-Lite0 beside the trivial model), with its own metrics; one failing model leaves the
others in service; traffic splits between versions as weighted; tritonclient reaches both."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton_http

from service.settings import Settings
from tests.conftest import running_gateway
from tests.triton_server import free_ports

MakeSettings = Callable[..., Settings]

ESPRESSO = 967
TWO_MODELS = "efficientnet-lite0,trivial"


def _labels(response: object) -> tuple[str, str, str]:
    body = response.json()  # type: ignore[attr-defined]
    return body["model"]["name"], body["model"]["version"], body["results"][0]["labels"][0]["label"]


async def test_two_real_models_answer_by_name_with_their_own_metrics(
    gateway_factory: MakeSettings, coffee_jpeg: bytes
) -> None:
    jpeg = {"content-type": "image/jpeg"}
    async with running_gateway(gateway_factory(models=TWO_MODELS)) as client:
        listed = (await client.get("/v1/models")).json()["models"]
        assert [(m["name"], m["default"], m["ready"]) for m in listed] == [
            ("efficientnet-lite0", True, True),
            ("trivial", False, True),
        ]
        assert listed[1]["versions"] == [
            {
                "version": "1",
                "profile": "trivial",
                "backend": "embedded",
                "traffic": 1.0,
                "ready": True,
                "loaded": True,
                "state": "ready",
                "reason": None,
            }
        ]
        named = await client.post("/v1/models/efficientnet-lite0/classify", content=coffee_jpeg, headers=jpeg)
        assert _labels(named) == ("efficientnet-lite0", "1", "espresso")
        default = await client.post("/classify", content=coffee_jpeg, headers=jpeg)
        assert _labels(default) == ("efficientnet-lite0", "1", "espresso")
        trivial = await client.post("/v1/models/trivial/versions/1/classify?top_k=2", content=coffee_jpeg, headers=jpeg)
        assert trivial.status_code == 200
        assert trivial.json()["model"] == {"name": "trivial", "version": "1", "random_weights": True}
        assert len(trivial.json()["results"][0]["labels"]) == 2

        metadata = (await client.get("/v1/models/trivial")).json()
        version = metadata["versions"][0]
        assert (version["image_size"], version["precision"], len(version["labels"])) == (224, "fp32", 1000)
        assert version["batching"]["max_batch_size"] == 16

        for path, detail in (
            ("/v1/models/nope/classify", "no model 'nope'; this gateway serves efficientnet-lite0, trivial"),
            ("/v1/models/trivial/versions/7/classify", "model 'trivial' has no version '7'; it has 1"),
            ("/v1/models/" + "x" * 300 + "/classify", "no model (a name of 300 characters)"),
        ):
            missing = await client.post(path, content=coffee_jpeg, headers=jpeg)
            assert missing.status_code == 404, path
            assert missing.json()["error"] == "not_found"
            assert missing.json()["detail"].startswith(detail)
        assert (await client.get("/v1/models/nope")).status_code == 404

        text = (await client.get("/metrics")).text
    counted = dict(
        re.findall(r'^gateway_images_classified_total\{mode="online",model="([^"]+)",version="1"\} (\S+)$', text, re.M)
    )
    assert counted == {"efficientnet-lite0": "2.0", "trivial": "1.0"}
    assert 'gateway_http_requests_total{method="POST",route="/v1/models/{name}/classify",status="404"}' in text


def _infer(url: str, model: str, image: bytes) -> triton_http.InferResult:
    client = triton_http.InferenceServerClient(url)
    try:
        tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
        wanted = triton_http.InferRequestedOutput("PROBABILITIES", class_count=1)
        return client.infer(model, [tensor], outputs=[wanted])
    finally:
        client.close()


async def test_tritonclient_reaches_both_models(gateway_factory: MakeSettings, coffee_jpeg: bytes) -> None:
    async with running_gateway(gateway_factory(models=TWO_MODELS)) as client:
        url = str(client.base_url).removeprefix("http://")
        real = await asyncio.to_thread(_infer, url, "efficientnet-lite0", coffee_jpeg)
        trivial = await asyncio.to_thread(_infer, url, "trivial", coffee_jpeg)
    assert real.get_response()["model_name"] == "efficientnet-lite0"
    assert real.as_numpy("PROBABILITIES")[0][0].decode().split(":")[1:] == [str(ESPRESSO), "espresso"]
    assert trivial.get_response()["model_name"] == "trivial"
    assert trivial.as_numpy("PROBABILITIES").shape == (1, 1)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def test_a_failing_model_leaves_the_others_in_service(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """One model's backend (a Triton nobody runs) is down: /readyz stays 200 and names it, its own
    readiness is 503, its requests fail with the backend's error, and the other model answers."""
    models = _write(
        tmp_path / "models.toml",
        """
        default = "good"
        [models.good]
        profile = "trivial"
        [models.broken]
        profile = "trivial"
        backend = "triton"
        triton_url = "127.0.0.1:9"
        breaker_threshold = 0
        """,
    )
    jpeg = {"content-type": "image/jpeg"}
    async with running_gateway(gateway_factory(models_file=models, readiness_interval=0.2)) as client:
        readyz = await client.get("/readyz")
        assert readyz.status_code == 200, readyz.text
        assert readyz.json()["checks"]["models"] == "not ready: broken"
        assert "unreachable" in readyz.json()["checks"]["backend broken/1"]
        assert (await client.get("/v2/models/broken/ready")).status_code == 503
        assert (await client.get("/v2/models/good/ready")).status_code == 200
        listed = {m["name"]: m["ready"] for m in (await client.get("/v1/models")).json()["models"]}
        assert listed == {"good": True, "broken": False}
        failed = await client.post("/v1/models/broken/classify", content=coffee_jpeg, headers=jpeg)
        assert failed.status_code in (500, 503), failed.text
        assert failed.json()["error"] in ("backend_error", "backend_unavailable")
        good = await client.post("/v1/models/good/classify", content=coffee_jpeg, headers=jpeg)
        assert good.status_code == 200


async def test_a_model_whose_triton_is_unreachable_is_unavailable_not_ready(
    gateway_factory: MakeSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model on a Triton nobody runs (a closed port) is logged unavailable, never ready, and listed
    with ``state`` one of the fixed states (``unavailable``), the error in ``reason``, and ``loaded``
    false (it was listed ``"loaded": true`` with the error text as its state); the model beside it is
    ``ready`` with no reason."""
    (closed,) = free_ports(1)
    models = _write(
        tmp_path / "models.toml",
        f"""
        default = "good"
        [models.good]
        profile = "trivial"
        backend = "fake"
        [models.remote]
        profile = "trivial"
        backend = "triton"
        triton_url = "127.0.0.1:{closed}"
        """,
    )
    caplog.set_level(logging.INFO, logger="service")
    async with running_gateway(gateway_factory(models_file=models)) as client:
        listed = {m["name"]: m["versions"][0] for m in (await client.get("/v1/models")).json()["models"]}
        one = (await client.get("/v1/models/remote")).json()["versions"][0]
    remote = listed["remote"]
    assert (remote["state"], remote["ready"], remote["loaded"]) == ("unavailable", False, False)
    assert "Triton is unreachable" in remote["reason"]
    assert str(closed) not in remote["reason"]  # its address is for the log (issue 46)
    assert (one["state"], one["reason"]) == (remote["state"], remote["reason"])
    good = listed["good"]
    assert (good["state"], good["ready"], good["loaded"], good["reason"]) == ("ready", True, True, None)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert not any(message.startswith("model remote version 1 ready") for _, message in said)
    assert any(
        level == logging.WARNING and message.startswith("model remote version 1 unavailable") for level, message in said
    )
    assert any(message.startswith("model good version 1 ready") for _, message in said)


async def test_traffic_splits_between_versions_as_weighted(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """A 90/10 canary: of 300 unversioned requests about 30 reach version 2 (binomial: 99.99 % of
    runs fall in 10-55); each version's own route always reaches it."""
    models = _write(
        tmp_path / "models.toml",
        """
        [models.shop]
        profile = "trivial"
        backend = "fake"
        [models.shop.versions.1]
        traffic = 90
        [models.shop.versions.2]
        traffic = 10
        """,
    )
    jpeg = {"content-type": "image/jpeg"}
    async with running_gateway(gateway_factory(models_file=models)) as client:
        answers = []
        for _ in range(6):  # 50 at a time: within the gateway's admission (64 in progress)
            answers += await asyncio.gather(
                *(client.post("/v1/models/shop/classify", content=coffee_jpeg, headers=jpeg) for _ in range(50))
            )
        versions = Counter(r.json()["model"]["version"] for r in answers)
        pinned = await client.post("/v1/models/shop/versions/2/classify", content=coffee_jpeg, headers=jpeg)
        listed = (await client.get("/v1/models")).json()["models"][0]["versions"]
    assert 10 <= versions["2"] <= 55, versions
    assert versions["1"] + versions["2"] == 300
    assert pinned.json()["model"]["version"] == "2"
    assert [v["traffic"] for v in listed] == [0.9, 0.1]


async def test_sticky_keys_keep_their_version_and_a_reload_moves_the_traffic(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """With ``sticky``, every request of an API key reaches one version (and the keys spread over
    both); rewriting the file's weights to 0/100 moves every key to version 2 without a restart,
    and a change that cannot be applied is refused, leaving the weights as they were."""
    text = """
        [models.shop]
        profile = "trivial"
        backend = "fake"
        sticky = true
        [models.shop.versions.1]
        traffic = {one}
        [models.shop.versions.2]
        traffic = {two}
        """
    models = _write(tmp_path / "models.toml", text.format(one=50, two=50))
    keys = [f"key-{i:02d}-secret-value" for i in range(20)]
    settings = gateway_factory(models_file=models, api_keys=",".join(keys))
    jpeg = {"content-type": "image/jpeg"}

    async def versions_of(key: str) -> set[str]:
        answers = [
            await client.post("/v1/models/shop/classify", content=coffee_jpeg, headers={**jpeg, "x-api-key": key})
            for _ in range(4)
        ]
        return {answer.json()["model"]["version"] for answer in answers}

    async with running_gateway(settings) as client:
        seen = [await versions_of(key) for key in keys]
        assert all(len(versions) == 1 for versions in seen), seen
        assert {next(iter(versions)) for versions in seen} == {"1", "2"}

        _write(models, text.format(one=0, two=100))
        async with asyncio.timeout(15):
            while (await versions_of(keys[0])) != {"2"} or (await versions_of(keys[1])) != {"2"}:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        assert {version for key in keys for version in await versions_of(key)} == {"2"}

        _write(models, text.format(one=0, two=100).replace("sticky = true", "sticky = true\nmax_batch_size = 0"))
        async with asyncio.timeout(15):
            refused = 'gateway_model_reloads_total{outcome="refused"} 1.0'
            while refused not in (await client.get("/metrics", headers={"x-api-key": keys[0]})).text:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        assert (await versions_of(keys[2])) == {"2"}
        listed = (await client.get("/v1/models", headers={"x-api-key": keys[0]})).json()["models"][0]
    assert [v["traffic"] for v in listed["versions"]] == [0.0, 1.0]
    assert listed["sticky"] is True


async def test_a_version_that_is_down_is_passed_over_while_another_serves(
    gateway_factory: MakeSettings, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    """Version 1 (traffic 90) on a Triton nobody runs, version 2 (10) up: the model is ready and
    every unversioned request reaches version 2; version 1's own route says why it cannot. Without
    a key, /readyz names no model; offline requests for a model other than the default are
    refused before anything is read or spent."""
    models = _write(
        tmp_path / "models.toml",
        """
        [models.shop]
        profile = "trivial"
        breaker_threshold = 0
        [models.shop.versions.1]
        traffic = 90
        backend = "triton"
        triton_url = "127.0.0.1:9"
        [models.shop.versions.2]
        traffic = 10
        backend = "fake"
        [models.other]
        profile = "trivial"
        backend = "fake"
        """,
    )
    key = {"x-api-key": "a-key-of-some-length"}
    jpeg = {"content-type": "image/jpeg", **key}
    settings = gateway_factory(models_file=models, readiness_interval=0.2, api_keys=key["x-api-key"])
    async with running_gateway(settings) as client:
        answers = [await client.post("/v1/models/shop/classify", content=coffee_jpeg, headers=jpeg) for _ in range(30)]
        assert {(a.status_code, a.json()["model"]["version"]) for a in answers} == {(200, "2")}
        pinned = await client.post("/v1/models/shop/versions/1/classify", content=coffee_jpeg, headers=jpeg)
        assert pinned.status_code in (500, 503), pinned.text
        assert (await client.get("/v2/models/shop/ready", headers=key)).status_code == 200
        assert (await client.get("/v2/models/shop/versions/1/ready", headers=key)).status_code == 503

        anonymous = await client.get("/readyz")
        assert anonymous.status_code == 200
        assert "shop" not in anonymous.text, anonymous.text
        assert "other" not in anonymous.text, anonymous.text
        assert anonymous.json()["checks"]["backend"] == "not ready"
        assert "backend shop/1" in (await client.get("/readyz", headers=key)).json()["checks"]

        for path in ("/v1/models/other/classify", "/v1/models/shop/versions/2/classify"):
            offline = await client.post(f"{path}?mode=offline", content=coffee_jpeg, headers=jpeg)
            assert offline.status_code == 400  # every model may queue jobs, where a broker is configured
            assert "mode=offline is not available" in offline.json()["detail"]


async def test_api_keys_may_be_limited_to_some_models_and_to_a_rate_on_one(
    gateway_factory: MakeSettings, coffee_jpeg: bytes
) -> None:
    """``models=`` limits a key to some models (403 for the others, naming those it may use);
    ``rate@MODEL=`` gives it a rate on one model within its own: over it, 429 for that model only."""
    keys = "only-the-trivial-model models=trivial,rated-on-trivial rate@trivial=0.1"
    settings = gateway_factory(models=TWO_MODELS, api_keys=keys, max_images_per_request=1, max_queue_size=16)
    jpeg = {"content-type": "image/jpeg"}
    limited = {**jpeg, "x-api-key": "only-the-trivial-model"}
    rated = {**jpeg, "x-api-key": "rated-on-trivial"}
    async with running_gateway(settings) as client:
        refused = await client.post("/v1/models/efficientnet-lite0/classify", content=coffee_jpeg, headers=limited)
        assert refused.status_code == 403
        assert refused.json()["detail"] == "this API key may not use model 'efficientnet-lite0'; it may use trivial"
        assert (await client.post("/classify", content=coffee_jpeg, headers=limited)).status_code == 403
        assert (
            await client.post("/v1/models/trivial/classify", content=coffee_jpeg, headers=limited)
        ).status_code == 200

        assert (await client.post("/v1/models/trivial/classify", content=coffee_jpeg, headers=rated)).status_code == 200
        over = await client.post("/v1/models/trivial/classify", content=coffee_jpeg, headers=rated)
        assert over.status_code == 429
        assert "over its rate on model 'trivial' of 0.1 images/s" in over.json()["detail"]
        assert int(over.headers["retry-after"]) >= 9
        other = await client.post("/v1/models/efficientnet-lite0/classify", content=coffee_jpeg, headers=rated)
        assert other.status_code == 200
