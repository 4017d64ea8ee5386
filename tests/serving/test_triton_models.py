"""Two models behind the gateway on a real Triton (the tests' tritonserver, Python backend): each
gateway model reaches its own Triton model (Triton's own counters say so), answers with its own
graph, and both are reachable with tritonclient through the gateway's Open Inference Protocol."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http

from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.settings import Settings
from service.triton.repository import TritonOptions, write_model
from service.triton.server import LocalTriton, TritonInstall
from tests.conftest import running_gateway
from tests.triton_server import start_triton

pytestmark = pytest.mark.triton

ESPRESSO = 967
JPEG = {"content-type": "image/jpeg"}
MODELS = """
[models.products]
profile = "efficientnet-lite0"
backend = "triton"
triton_url = "{url}"
[models.moderation]
profile = "trivial"
backend = "triton"
triton_url = "{url}"
max_batch_size = 8
"""


@pytest.fixture(scope="module")
def two_model_triton(
    triton_install: TritonInstall, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTriton]:
    """Triton in explicit model control mode with two models in its repository, both loaded."""
    repository = tmp_path_factory.mktemp("two-models")
    options = TritonOptions(variant="python", max_batch_size=32, intra_op_threads=1)
    for name, profile_name in (("products", "efficientnet-lite0"), ("moderation", "trivial")):
        profile = get_profile(profile_name)
        write_model(repository, profile, options, ensure_model(models_dir, profile), name=name)
    explicit = ("--model-control-mode=explicit", "--load-model=products", "--load-model=moderation")
    server = start_triton(triton_install, repository, tmp_path_factory.mktemp("two-model-logs"), extra_args=explicit)
    yield server
    server.stop()


def _write_moderation(repository: Path, models_dir: Path, max_batch_size: int) -> None:
    profile = get_profile("trivial")
    options = TritonOptions(variant="python", max_batch_size=max_batch_size, intra_op_threads=1)
    write_model(repository, profile, options, ensure_model(models_dir, profile), name="moderation")


def _infer(url: str, model: str, image: bytes) -> triton_http.InferResult:
    client = triton_http.InferenceServerClient(url)
    try:
        tensor = triton_http.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
        return client.infer(model, [tensor], outputs=[triton_http.InferRequestedOutput("PROBABILITIES", class_count=1)])
    finally:
        client.close()


def _triton_counts(triton: LocalTriton) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{triton.ports.metrics}/metrics").text
    return {
        model: float(count)
        for model, count in re.findall(r'^nv_inference_count\{model="([^"]+)",version="1"\} (\S+)$', text, re.M)
    }


async def test_two_models_on_triton_each_reach_their_own(
    gateway_factory: Callable[..., Settings], two_model_triton: LocalTriton, tmp_path: Path, coffee_jpeg: bytes
) -> None:
    models = tmp_path / "models.toml"
    models.write_text(MODELS.format(url=two_model_triton.grpc_url))
    jpeg = {"content-type": "image/jpeg"}
    before = _triton_counts(two_model_triton)
    async with running_gateway(gateway_factory(models_file=models)) as client:
        listed = (await client.get("/v1/models")).json()["models"]
        assert [(m["name"], m["ready"], m["versions"][0]["backend"]) for m in listed] == [
            ("products", True, "triton"),
            ("moderation", True, "triton"),
        ]
        products = await client.post("/v1/models/products/classify", content=coffee_jpeg, headers=jpeg)
        assert products.json()["results"][0]["labels"][0]["label"] == "espresso"
        assert products.json()["model"] == {"name": "products", "version": "1", "random_weights": False}
        for _ in range(3):
            moderation = await client.post("/v1/models/moderation/classify", content=coffee_jpeg, headers=jpeg)
            assert moderation.status_code == 200
            assert moderation.json()["model"]["name"] == "moderation"
        url = str(client.base_url).removeprefix("http://")
        real = await asyncio.to_thread(_infer, url, "products", coffee_jpeg)
        trivial = await asyncio.to_thread(_infer, url, "moderation", coffee_jpeg)
    assert real.as_numpy("PROBABILITIES")[0][0].decode().split(":")[1:] == [str(ESPRESSO), "espresso"]
    assert trivial.get_response()["model_name"] == "moderation"
    after = _triton_counts(two_model_triton)
    assert after["products"] - before.get("products", 0.0) == 2  # /classify and the tritonclient call
    assert after["moderation"] - before.get("moderation", 0.0) == 4


async def test_models_found_in_tritons_index_are_served_and_loaded_when_the_operator_asks(
    gateway_factory: Callable[..., Settings],
    two_model_triton: LocalTriton,
    tmp_path: Path,
    coffee_jpeg: bytes,
    models_dir: Path,
) -> None:
    """The models file names one model and Triton's index has a second: the gateway serves both;
    the operator unloads the second through the gateway (admin key), it is refused (503), the
    gateway and Triton say not ready; loads it again, it answers. Without the key, 403; the other
    model never stops. Reloaded as another model, it is checked again."""
    url = two_model_triton.grpc_url
    models = tmp_path / "models.toml"
    models.write_text(
        f'[triton]\nurl = "{url}"\nprofile = "efficientnet-lite0"\n'
        f'[models.products]\nprofile = "efficientnet-lite0"\nbackend = "triton"\ntriton_url = "{url}"\n'
    )
    admin = {"x-admin-key": "an-admin-key-for-the-test"}
    settings = gateway_factory(models_file=models, admin_key=admin["x-admin-key"], readiness_interval=0.2)
    async with running_gateway(settings) as client:
        listed = {m["name"]: m["ready"] for m in (await client.get("/v1/models")).json()["models"]}
        assert listed == {"products": True, "moderation": True}
        assert (await client.post("/v1/models/moderation/unload")).status_code == 403
        assert (await client.post("/v1/models/moderation/unload", headers={"x-admin-key": "wrong"})).status_code == 403

        unloaded = await client.post("/v1/models/moderation/unload", headers=admin)
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json()["ready"] is False
        version = unloaded.json()["versions"][0]  # a state of the fixed set, Triton's answer as its reason
        assert (version["state"], version["loaded"]) == ("unavailable", False)
        assert "not ready" in version["reason"]
        refused = await client.post("/v1/models/moderation/classify", content=coffee_jpeg, headers=JPEG)
        assert refused.status_code == 503, refused.text
        state = await client.get(f"http://{two_model_triton.http_url}/v2/models/moderation/ready")
        assert state.status_code == 400  # Triton's own answer for a model it does not serve now

        loaded = await client.post("/v1/models/moderation/load", headers=admin)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["ready"] is True
        version = loaded.json()["versions"][0]
        assert (version["state"], version["loaded"], version["reason"]) == ("ready", True, None)
        answer = await client.post("/v1/models/moderation/classify", content=coffee_jpeg, headers=JPEG)
        assert answer.status_code == 200, answer.text
        products = await client.post("/v1/models/products/classify", content=coffee_jpeg, headers=JPEG)
        assert products.json()["results"][0]["labels"][0]["label"] == "espresso"
        assert (await client.post("/v1/models/nope/load", headers=admin)).status_code == 404

        # reloaded as another model (batches of at most 4, where the gateway sends up to 32): the
        # gateway checks what it loaded again, and says what is wrong, rather than trust the old check
        await client.post("/v1/models/moderation/unload", headers=admin)
        _write_moderation(two_model_triton.repository, models_dir, max_batch_size=4)
        try:
            swapped = await client.post("/v1/models/moderation/load", headers=admin)
            assert swapped.json()["ready"] is False
            checks = (await client.get("/readyz", headers=admin)).json()["checks"]
            assert "exceeds model moderation's max_batch_size 4" in checks["backend moderation/1"]
        finally:
            await client.post("/v1/models/moderation/unload", headers=admin)
            _write_moderation(two_model_triton.repository, models_dir, max_batch_size=32)
            assert (await client.post("/v1/models/moderation/load", headers=admin)).json()["ready"] is True
