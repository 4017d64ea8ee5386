"""The OpenVINO backend and its INT8 models, on real photos: each precision must answer like FP32
(ONNX Runtime) on photos with a clear answer, the quantiser must refuse a model that does not, and
the gateway must serve through it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

import service.backends.openvino as openvino_module
import service.models.quantize as quantize_module
from loadtests.harness.backend_alone import scores_of
from loadtests.harness.dataset import build
from service.backends.embedded import EmbeddedBackend
from service.backends.openvino import OpenVINOBackend, Precision, has_bf16
from service.models.profiles import get_profile
from service.models.quantize import (
    MIN_AGREEMENT,
    QuantizationRefused,
    agreement,
    clear_answers,
    ensure_int8,
    int8_path,
    model_inputs,
    photos_in,
)
from service.models.store import model_path
from tests.conftest import CAT_CLASSES, running_gateway
from tests.http.test_api import MakeSettings

PROFILE = get_profile("efficientnet-lite0")


@pytest.fixture(scope="module")
def photo_sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Calibration and evaluation photos: distinct crops of scikit-image's sample photos (other
    seeds, so no evaluation photo was seen in calibration)."""
    root = tmp_path_factory.mktemp("photos")
    calibration = build(root / "calibration", count=160, seed=1).folder / "originals"
    evaluation = build(root / "evaluation", count=400, seed=2).folder / "originals"
    return calibration, evaluation


@pytest.fixture(scope="module")
def int8_model(models_dir: Path, photo_sets: tuple[Path, Path]) -> Path:
    if not quantize_module.has_vnni():
        pytest.skip("this CPU has no VNNI: INT8 is refused on it (test_int8_is_refused_on_a_cpu_without_vnni)")
    return ensure_int8(models_dir, PROFILE, model_path(models_dir, PROFILE), photo_sets[0])


@pytest.fixture
def vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the VNNI check, to test what comes after it on any CPU."""
    monkeypatch.setattr(quantize_module, "has_vnni", lambda: True)


def test_int8_is_refused_on_a_cpu_without_vnni(
    tmp_path: Path, models_dir: Path, photo_sets: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quantize_module, "has_vnni", lambda: False)
    with pytest.raises(QuantizationRefused, match=r"no VNNI instructions.*serve fp32 or bf16"):
        ensure_int8(tmp_path, PROFILE, model_path(models_dir, PROFILE), photo_sets[0])
    assert not int8_path(tmp_path, PROFILE).exists()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
async def test_each_precision_answers_like_fp32_on_photos_with_a_clear_answer(
    precision: Precision, models_dir: Path, photo_sets: tuple[Path, Path], request: pytest.FixtureRequest
) -> None:
    images = np.stack(model_inputs(photos_in(photo_sets[1]), PROFILE))
    onnx = model_path(models_dir, PROFILE)
    reference = await scores_of(EmbeddedBackend(onnx), images)
    clear = clear_answers(reference)
    assert clear.sum() >= 150, "the evaluation set needs photos with a clear answer"
    assert len(set(reference[clear].argmax(axis=1))) >= 10, "and more than a few classes"
    path = request.getfixturevalue("int8_model") if precision == "int8" else onnx
    scores = await scores_of(OpenVINOBackend(path, precision=precision, threads=2), images)
    result = agreement(reference[clear], scores[clear])
    print(f"\n{precision}: {result} with a clear answer; {agreement(reference, scores)} in all")
    assert result.top1 >= MIN_AGREEMENT
    if precision == "fp32":
        assert agreement(reference, scores).max_score_diff < 1e-4  # the same arithmetic, another runtime
    else:
        assert result.max_score_diff < 0.25


def test_the_int8_model_records_how_it_was_built_and_is_reused(
    models_dir: Path, photo_sets: tuple[Path, Path], int8_model: Path
) -> None:
    meta = json.loads((int8_model.parent / "build.json").read_text())
    assert meta["photos"] == 160
    assert meta["held_out_clear"]["top1"] >= MIN_AGREEMENT
    assert meta["held_out"]["images"] == 40
    stamp = int8_model.stat().st_mtime_ns
    onnx = model_path(models_dir, PROFILE)
    assert ensure_int8(models_dir, PROFILE, onnx, photo_sets[0]) == int8_model  # same photos: cached
    assert ensure_int8(models_dir, PROFILE, onnx, None) == int8_model  # no photos: the cached one
    assert int8_model.stat().st_mtime_ns == stamp


@pytest.mark.usefixtures("vnni")
def test_without_photos_or_a_cached_model_int8_says_how_to_get_one(tmp_path: Path, models_dir: Path) -> None:
    with pytest.raises(QuantizationRefused, match="GATEWAY_CALIBRATION_DIR"):
        ensure_int8(tmp_path, PROFILE, model_path(models_dir, PROFILE), None)
    few = build(tmp_path / "few", count=8, seed=3).folder / "originals"
    with pytest.raises(QuantizationRefused, match="8 usable photos"):
        ensure_int8(tmp_path, PROFILE, model_path(models_dir, PROFILE), few)
    assert not int8_path(tmp_path, PROFILE).exists()


@pytest.mark.usefixtures("vnni")
def test_a_quantised_model_that_disagrees_is_refused_and_not_written(
    tmp_path: Path, models_dir: Path, photo_sets: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No INT8 model agrees on more than every photo: demanding that must refuse it, and leave
    nothing behind that a later start could pick up."""
    monkeypatch.setattr(quantize_module, "MIN_AGREEMENT", 1.01)
    with pytest.raises(QuantizationRefused, match="the INT8 model was refused: top-1 agreement"):
        ensure_int8(tmp_path, PROFILE, model_path(models_dir, PROFILE), photo_sets[0])
    assert not int8_path(tmp_path, PROFILE).exists()
    with pytest.raises(QuantizationRefused, match="GATEWAY_CALIBRATION_DIR"):
        ensure_int8(tmp_path, PROFILE, model_path(models_dir, PROFILE), None)


async def test_without_bf16_kernels_it_runs_fp32_and_readyz_says_so(
    gateway_factory: MakeSettings, cat_jpeg: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openvino_module, "has_bf16", lambda core: False)
    settings = gateway_factory(model="efficientnet-lite0", backend="openvino", openvino_precision="bf16")
    async with running_gateway(settings) as client:
        ready = await client.get("/readyz")
        answer = await client.post("/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
    assert ready.status_code == 200
    assert "bf16 asked for; running fp32" in ready.json()["checks"]["runtime"]
    assert answer.status_code == 200
    assert answer.json()["results"][0]["labels"][0]["index"] in CAT_CLASSES


@pytest.mark.parametrize("precision", ["bf16", "int8"])
async def test_the_gateway_serves_photos_through_openvino(
    precision: Precision,
    gateway_factory: MakeSettings,
    cat_jpeg: bytes,
    coffee_jpeg: bytes,
    photo_sets: tuple[Path, Path],
    request: pytest.FixtureRequest,
) -> None:
    if precision == "int8":
        request.getfixturevalue("int8_model")
    settings = gateway_factory(
        model="efficientnet-lite0", backend="openvino", openvino_precision=precision, calibration_dir=photo_sets[0]
    )
    async with running_gateway(settings) as client:
        ready = (await client.get("/readyz")).json()
        files = [("file", ("cat.jpg", cat_jpeg, "image/jpeg")), ("file", ("coffee.jpg", coffee_jpeg, "image/jpeg"))]
        answer = await client.post("/classify", files=files)
    assert ready["checks"]["runtime"].startswith("OpenVINO ")
    bf16_kernels = has_bf16(ov.Core()) if precision == "bf16" else True
    assert ready["checks"]["runtime"].endswith(
        precision if bf16_kernels else "running fp32: this CPU has no bf16 kernels"
    )
    assert answer.status_code == 200
    cat, coffee = (result["labels"][0]["index"] for result in answer.json()["results"])
    assert cat in CAT_CLASSES
    assert coffee == 967  # espresso
