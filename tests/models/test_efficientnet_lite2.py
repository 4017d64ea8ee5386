"""A user's real model end to end: EfficientNet-Lite2 written in torch and exported to ONNX as a
user would (``tests.models.exports``), declared, derived, and run by the gateway's own backends on
real photos. It must name the cat and the espresso, equal torch's own output on the same pixels,
and give the same answer through every input convention a user's file may come in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest

from loadtests.harness.backend_alone import scores_of
from service.backends.embedded import EmbeddedBackend
from service.backends.openvino import OpenVINOBackend
from service.images.preprocess import PreprocessConfig, prepare
from service.models.declaration import parse_declaration
from service.models.profiles import ModelProfile, imagenet_labels
from service.models.reading import complete
from service.models.store import ensure_model
from tests.conftest import CAT_CLASSES, ESPRESSO
from tests.models.exports import PLAIN, SIZES, VARIANTS, Exports, torch_scores

pytestmark = pytest.mark.model  # real EfficientNet-Lite1/2 networks exported and run

CONVENTIONS = ["nhwc-bgr-caffe", "float16", "minus-one-one", "softmax"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """The EfficientNet-Lite exports, made on first use and kept for the module."""
    return Exports(tmp_path_factory.mktemp("exports"))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def photos(cat_jpeg: bytes, coffee_jpeg: bytes, size: int) -> np.ndarray:
    """The cat and the espresso, as the gateway prepares them for a model of ``size`` pixels."""
    config = PreprocessConfig(height=size, width=size)
    return np.stack([prepare(cat_jpeg, config), prepare(coffee_jpeg, config)])


@pytest.fixture(scope="module")
def lite2_photos(cat_jpeg: bytes, coffee_jpeg: bytes) -> np.ndarray:
    return photos(cat_jpeg, coffee_jpeg, SIZES["lite2"])


@pytest.fixture(scope="module")
def lite2_logits(lite2_photos: np.ndarray) -> np.ndarray:
    return torch_scores(PLAIN, lite2_photos)


def declared(file: Path, keys: dict[str, Any], name: str = "lite2") -> ModelProfile:
    where = f"models.toml: model {name!r} version '1'"
    declaration = parse_declaration({"path": file.name, **keys}, where, base=file.parent, root=None)
    return complete(declaration, name=name, version="1", max_batch_size=16)


def derived(exports: Exports, name: str, models: Path, output: str | None = None) -> Path:
    """The gateway's derived file of a variant, declared as its convention says."""
    variant = VARIANTS[name]
    keys = variant.declaration(output)
    if keys["output"] != "embedding":
        keys["labels"] = list(imagenet_labels())
    return ensure_model(models, declared(exports.path(name), keys, name))


def assert_cat_and_espresso(scores: np.ndarray) -> None:
    assert scores.argmax(axis=1)[0] in CAT_CLASSES
    assert scores.argmax(axis=1)[1] == ESPRESSO


@pytest.mark.parametrize("backend", ["embedded", "openvino"])
async def test_lite2_names_the_photos_and_equals_torch(
    exports: Exports, tmp_path: Path, lite2_photos: np.ndarray, lite2_logits: np.ndarray, backend: str
) -> None:
    """The plain export (NCHW float32, ``(x - 127) / 128`` declared, logits out) on ONNX Runtime and
    on OpenVINO: the cat and the espresso, and torch's softmax within float32 rounding."""
    path = derived(exports, "plain", tmp_path / "models")
    runner = EmbeddedBackend(path) if backend == "embedded" else OpenVINOBackend(path, precision="fp32")
    scores = await scores_of(runner, lite2_photos)
    assert scores.dtype == np.float32
    assert scores.shape == (2, 1000)
    assert_cat_and_espresso(scores)
    np.testing.assert_allclose(scores, softmax(lite2_logits), atol=2e-5)


@pytest.mark.parametrize("name", CONVENTIONS)
async def test_every_convention_answers_as_the_plain_export(
    exports: Exports, tmp_path: Path, lite2_photos: np.ndarray, lite2_logits: np.ndarray, name: str
) -> None:
    """NHWC BGR with Keras' caffe means, float16, [-1, 1], softmax in the graph: each model undoes
    its convention inside, so fed as declared it gives torch's answer (a wrong channel order or
    mean would not)."""
    scores = await scores_of(EmbeddedBackend(derived(exports, name, tmp_path / "models")), lite2_photos)
    assert_cat_and_espresso(scores)
    tolerance = 5e-3 if name == "float16" else 2e-5
    np.testing.assert_allclose(scores, softmax(lite2_logits), atol=tolerance)


async def test_a_sigmoid_head(
    exports: Exports, tmp_path: Path, lite2_photos: np.ndarray, lite2_logits: np.ndarray
) -> None:
    """The logits declared ``output = "sigmoid"``: independent scores, torch's sigmoid of its logits."""
    scores = await scores_of(EmbeddedBackend(derived(exports, "plain", tmp_path / "models", "sigmoid")), lite2_photos)
    np.testing.assert_allclose(scores, sigmoid(lite2_logits), atol=2e-5)
    assert_cat_and_espresso(scores)


async def test_an_embedding(exports: Exports, tmp_path: Path, lite2_photos: np.ndarray) -> None:
    """The network cut before its classifier (``[N, 1280, 1, 1]``): torch's pooled features, flattened."""
    profile_path = derived(exports, "embedding", tmp_path / "models")
    scores = await scores_of(EmbeddedBackend(profile_path), lite2_photos)
    np.testing.assert_allclose(scores, torch_scores(VARIANTS["embedding"], lite2_photos), rtol=1e-4, atol=1e-4)


async def test_an_openvino_ir(
    exports: Exports, tmp_path: Path, lite2_photos: np.ndarray, lite2_logits: np.ndarray
) -> None:
    """The NHWC BGR export converted to an OpenVINO IR and declared as such: OpenVINO's own pre- and
    post-processing feeds it, with the same answer."""
    variant = VARIANTS["nhwc-bgr-caffe"]
    xml = tmp_path / "lite2.xml"
    ov.save_model(ov.convert_model(exports.path("nhwc-bgr-caffe")), str(xml), compress_to_fp16=False)
    keys = variant.declaration() | {"labels": list(imagenet_labels())}
    path = ensure_model(tmp_path / "models", declared(xml, keys))
    scores = await scores_of(OpenVINOBackend(path, precision="fp32"), lite2_photos)
    assert_cat_and_espresso(scores)
    np.testing.assert_allclose(scores, softmax(lite2_logits), atol=2e-5)


async def test_lite1_at_its_own_size(exports: Exports, tmp_path: Path, cat_jpeg: bytes, coffee_jpeg: bytes) -> None:
    """Lite1 (240 px, its own widths and depth): its size is read from its file."""
    keys = VARIANTS["lite1"].declaration() | {"labels": list(imagenet_labels())}
    profile = declared(exports.path("lite1"), keys, "lite1")
    assert profile.input_size == (240, 240)
    rgb = photos(cat_jpeg, coffee_jpeg, 240)
    scores = await scores_of(EmbeddedBackend(ensure_model(tmp_path / "models", profile)), rgb)
    assert_cat_and_espresso(scores)
    np.testing.assert_allclose(scores, softmax(torch_scores(VARIANTS["lite1"], rgb)), atol=2e-5)
