"""The ``torch`` backend (ResNet-50 in PyTorch, the GPU path's model) on the CPU: the same
classifier as the ONNX graph, batch padding that never leaks into answers, and a gateway serving it."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from loadtests.harness.photos import sample_photos
from service.backends.embedded import EmbeddedBackend
from service.backends.torch_backend import TorchBackend, buckets
from service.images.preprocess import PreprocessConfig, prepare
from service.models import resnet
from service.models.profiles import get_profile
from service.models.store import ensure_model
from tests.conftest import running_gateway

pytestmark = pytest.mark.model  # PyTorch models, built and run in this process


@asynccontextmanager
async def started(backend: TorchBackend) -> AsyncIterator[TorchBackend]:
    await backend.start()
    try:
        yield backend
    finally:
        await backend.aclose()


def test_buckets_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(24) == [1, 2, 4, 8, 16, 24]
    measured = TorchBackend(None, device="cpu", max_batch_size=256, bucket_sizes=[64, 1, 8, 64])
    assert measured._buckets == [1, 8, 64]  # some batch sizes alone (a measurement), each once


@pytest.fixture(scope="module")
def sample_jpegs() -> list[bytes]:
    """scikit-image's sample photos (a cat, a coffee cup, an astronaut...) as JPEGs."""
    return [data for _, data in sample_photos()]


@pytest.fixture(scope="module")
def photos_rgb(sample_jpegs: list[bytes]) -> np.ndarray:
    config = PreprocessConfig()
    return np.stack([prepare(data, config) for data in sample_jpegs[:5]])


async def test_torch_and_onnx_give_the_same_probabilities(photos_rgb: np.ndarray, models_dir: Path) -> None:
    torch_backend = TorchBackend(None, device="cpu", max_batch_size=8, max_concurrency=2)
    onnx_backend = EmbeddedBackend(ensure_model(models_dir, get_profile("resnet50")))
    await torch_backend.start()
    await onnx_backend.start()
    try:
        assert await torch_backend.ready() is None
        got = await torch_backend.infer(list(photos_rgb))
        want = await onnx_backend.infer(list(photos_rgb))
    finally:
        await torch_backend.aclose()
        await onnx_backend.aclose()
    assert got.shape == (len(photos_rgb), 1000)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)


async def test_a_padded_batch_answers_each_image_as_alone(photos_rgb: np.ndarray) -> None:
    """Three images run in the bucket of four: the padding row (stale data from a larger batch
    before) must not change the three answers, and each row is its own image's."""
    async with started(TorchBackend(None, device="cpu", max_batch_size=4, max_concurrency=1)) as backend:
        await backend.infer(list(photos_rgb[:4][::-1]))  # leaves other images in the staging rows
        together = await backend.infer(list(photos_rgb[:3]))
        alone = [await backend.infer([image]) for image in photos_rgb[:3]]
    np.testing.assert_allclose(together, np.concatenate(alone), rtol=1e-4, atol=1e-7)
    assert not np.allclose(together[0], together[1])


async def test_concurrent_batches_on_several_threads_stay_apart(photos_rgb: np.ndarray) -> None:
    """Each backend thread has its own staging buffer: batches in flight together keep their rows."""
    async with started(TorchBackend(None, device="cpu", max_batch_size=2, max_concurrency=3)) as backend:
        singles = [await backend.infer([image]) for image in photos_rgb[:3]]
        results = await asyncio.gather(*(backend.infer([image]) for image in photos_rgb[:3]))
    for got, want in zip(results, singles, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
async def test_the_compiled_pass_answers_as_the_eager_one(photos_rgb: np.ndarray) -> None:
    """``compile="on"``: the bucket compiled by Inductor at warm-up (one bucket here: a compile
    takes half a minute on 2 cores), the weights frozen in; the same photo then gets eager's
    probabilities within float tolerance, and the same top-1. The detail says it is compiled. A
    CUDA graph's input passes the compiled pass's guards: running the pass on it compiles nothing
    again (a guard for the capture, which must not compile; on the CPU there is no capture)."""
    import torch
    from torch._dynamo.utils import counters

    images = list(photos_rgb[:1])
    async with started(TorchBackend(None, device="cpu", max_batch_size=1, max_concurrency=1)) as eager:
        want = await eager.infer(images)
    compiled = TorchBackend(None, device="cpu", max_batch_size=1, max_concurrency=1, compile="on")
    async with started(compiled) as backend:
        assert await backend.ready() is None
        assert "torch.compile (on)" in (backend.detail or "")
        got = await backend.infer(images)
        compiled_graphs = counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            backend._forward(backend._static_input(1))
        assert counters["stats"]["unique_graphs"] == compiled_graphs
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
    assert got.argmax() == want.argmax()


def test_each_compiled_version_adds_its_graphs_to_the_recompile_limit() -> None:
    """Every instance compiles the one method, so the limit on its graphs is shared: each adds its
    buckets (two versions of 7 buckets passed the old ``max(limit, 8)`` and the second's warm-up
    failed). Loading compiles nothing yet (that is the warm-up's)."""
    from torch._dynamo import config as dynamo_config

    before = dynamo_config.cache_size_limit
    for _ in range(2):
        TorchBackend(None, device="cpu", max_batch_size=64, compile="on")._load()
    assert dynamo_config.cache_size_limit == before + 2 * (len(buckets(64)) + 1)


async def test_a_weights_file_missing_parameters_keeps_the_backend_unready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    state = resnet.random_state_dict(seed=1)
    del state["layer4.2.conv3.weight"]
    path = tmp_path / "partial.pth"
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    async with started(TorchBackend(path, device="cpu", max_batch_size=1)) as backend:
        problem = await backend.ready()
    assert problem is not None
    assert "failed to load (ValueError" in problem
    assert "layer4.2.conv3.weight" in caplog.text  # what is missing: in the log (a reason names no path)


async def test_torchvision_weights_load_and_are_not_called_random(tmp_path: Path, photos_rgb: np.ndarray) -> None:
    import torch

    state = resnet.random_state_dict(seed=2)
    path = tmp_path / "resnet50.pth"
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    async with started(TorchBackend(path, device="cpu", max_batch_size=1)) as backend:
        got = await backend.infer([photos_rgb[0]])
    assert not backend.random_weights
    assert backend.detail is not None
    assert "RANDOM" not in backend.detail
    async with started(TorchBackend(None, device="cpu", max_batch_size=1)) as default:
        other = await default.infer([photos_rgb[0]])
    assert not np.allclose(got, other)  # the file's weights were used, not seed 0's


@pytest.mark.slow
async def test_a_gateway_serves_the_torch_backend(gateway_factory, sample_jpegs: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    settings = gateway_factory(backend="torch", model="resnet50", torch_device="cpu", max_batch_size=4)
    async with running_gateway(settings) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        runtime = ready.json()["checks"]["runtime"]
        assert "PyTorch" in runtime
        assert "RANDOM WEIGHTS" in runtime
        files = [("file", (f"{i}.jpg", io.BytesIO(data), "image/jpeg")) for i, data in enumerate(sample_jpegs[:3])]
        answer = await client.post("/classify", files=files)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"]["name"] == "resnet50"
        assert len(body["results"]) == 3
        assert all(len(result["labels"]) == 5 for result in body["results"])


async def test_the_torch_backend_refuses_other_models(gateway_factory) -> None:  # type: ignore[no-untyped-def]
    from service.backends.factory import build_backend

    settings = gateway_factory(backend="torch", model="trivial", torch_device="cpu")
    with pytest.raises(ValueError, match="serves resnet50"):
        await build_backend(settings, get_profile("trivial"))
