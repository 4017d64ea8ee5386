"""INT8 models for the OpenVINO backend: post-training quantisation with NNCF, calibrated on photos.

The photos go through the gateway's own preprocessing (``prepare``), so the calibration sees exactly
what the model will be served. Every fourth photo is held out; the quantised model is written only
if its top-1 answer agrees with the FP32 model's on at least ``MIN_AGREEMENT`` of the held-out
photos that have a clear answer (``CLEAR_MARGIN``), so an INT8 model that answers differently is
refused rather than served.

Layout: ``<models_dir>/<name>/<version>/int8/model.xml`` (+ ``model.bin``) and ``build.json`` with
what it was built from (the FP32 ONNX file's SHA-256, the photos' SHA-256, the NNCF and OpenVINO
versions) and the agreement measured. A change to any of them rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from service.errors import GatewayError
from service.host.cpus import has_bf16, has_vnni
from service.host.files import atomic_folder
from service.images.files import is_image_file
from service.images.preprocess import PreprocessConfig, prepare
from service.models.profiles import ModelProfile
from service.models.store import recorded_sha256

logger = logging.getLogger(__name__)

MIN_AGREEMENT = 0.99
"""Top-1 agreement with FP32, on photos with a clear FP32 answer, below which a model is refused."""
CLEAR_MARGIN = 0.1
"""A photo has a clear answer when FP32's top class leads the next by this much probability. On
near-ties (a crop that is half keyboard, half mouse) any change of arithmetic flips the answer, bf16
included, so agreement there measures the photo, not the precision; both are reported."""
MIN_CLEAR = 8
"""Held-out photos with a clear answer needed to judge a quantised model."""
MIN_PHOTOS = 32
HOLDOUT_EVERY = 4


class QuantizationRefused(RuntimeError):
    """The photos could not calibrate the model, or the INT8 model disagrees with FP32 too often."""


@dataclass(frozen=True)
class Agreement:
    images: int
    top1: float
    """Share of images whose top-1 class is the reference's."""
    max_score_diff: float
    """Largest absolute difference of any class's probability."""

    def __str__(self) -> str:
        return (
            f"top-1 agreement {self.top1:.1%} on {self.images} images, "
            f"largest score difference {self.max_score_diff:.4f}"
        )


def clear_answers(reference: np.ndarray, margin: float = CLEAR_MARGIN) -> np.ndarray:
    """Rows of ``reference`` whose top class leads the next by at least ``margin`` (a boolean mask)."""
    top2 = np.sort(reference, axis=1)[:, -2:]
    mask: np.ndarray = top2[:, 1] - top2[:, 0] >= margin
    return mask


def agreement(reference: np.ndarray, scores: np.ndarray) -> Agreement:
    """How far ``scores`` (``[N, classes]``) is from ``reference``."""
    return Agreement(
        images=len(reference),
        top1=float(np.mean(reference.argmax(axis=1) == scores.argmax(axis=1))),
        max_score_diff=float(np.abs(reference - scores).max()),
    )


def photos_in(folder: Path) -> list[Path]:
    """Image files under ``folder`` (searched recursively), in a stable order."""
    return sorted(p for p in folder.rglob("*") if is_image_file(p))


def model_inputs(paths: list[Path], profile: ModelProfile) -> list[np.ndarray]:
    """The photos as the model sees them; files that are not usable images are skipped, with a log line."""
    config = PreprocessConfig(profile.height, profile.width, profile.resize, profile.crop_fraction)
    out = []
    for path in paths:
        try:
            out.append(prepare(path.read_bytes(), config))
        except GatewayError as exc:
            logger.warning("quantize: skipping %s: %s", path, exc.detail)
    return out


def int8_path(models_dir: Path, profile: ModelProfile) -> Path:
    return models_dir / profile.name / profile.version / "int8" / "model.xml"


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _run(model: object, images: np.ndarray, hint: str = "f32", batch: int = 16) -> np.ndarray:
    import openvino as ov

    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint})
    request = compiled.create_infer_request()
    return np.concatenate(
        [np.array(request.infer({0: images[i : i + batch]})[0]) for i in range(0, len(images), batch)]
    )


def quantize(onnx_path: Path, inputs: list[np.ndarray], out: Path, metadata: dict[str, object]) -> Agreement:
    """Quantise ``onnx_path`` on the calibration part of ``inputs``, check it on the held-out part,
    and write the INT8 model to ``out`` (``model.xml``, with ``build.json``: ``metadata`` and the
    agreement) only if it agrees with FP32 well enough."""
    import nncf
    import openvino as ov
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    if len(inputs) < MIN_PHOTOS:
        raise QuantizationRefused(f"{len(inputs)} usable photos; calibration needs at least {MIN_PHOTOS}")
    held_out = np.stack(inputs[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY])
    calibration = [x for i, x in enumerate(inputs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    model = ov.Core().read_model(onnx_path)
    overflow = OverflowFix.DISABLE if has_vnni() else OverflowFix.ENABLE
    quantized = nncf.quantize(
        model,
        nncf.Dataset(calibration, lambda image: image[None]),
        subset_size=len(calibration),
        advanced_parameters=AdvancedQuantizationParameters(overflow_fix=overflow),
    )
    served_hint = "bf16" if has_bf16(ov.Core()) else "f32"  # as the backend will run it
    reference, scores = _run(model, held_out), _run(quantized, held_out, served_hint)
    clear = clear_answers(reference)
    if clear.sum() < MIN_CLEAR:
        raise QuantizationRefused(
            f"only {clear.sum()} of {len(held_out)} held-out photos have a clear answer (FP32's top class "
            f"{CLEAR_MARGIN} ahead); at least {MIN_CLEAR} are needed to judge the INT8 model: add photos"
        )
    result = agreement(reference[clear], scores[clear])
    overall = agreement(reference, scores)
    if result.top1 < MIN_AGREEMENT:
        raise QuantizationRefused(
            f"the INT8 model was refused: {result} with a clear answer ({overall} in all); "
            f"at least {MIN_AGREEMENT:.0%} needed"
        )
    record = {**metadata, "overflow_fix": overflow.value, "held_out_clear": asdict(result), "held_out": asdict(overall)}
    try:
        with atomic_folder(out.parent) as tmp:  # the folder appears whole or not at all
            ov.save_model(quantized, str(tmp / out.name), compress_to_fp16=False)
            (tmp / "build.json").write_text(json.dumps(record, indent=2))
    except OSError as exc:  # e.g. the runtime image's read-only models folder
        raise QuantizationRefused(
            f"the INT8 model could not be written to {out.parent}: {exc.strerror or exc}; quantize it where the "
            "models folder is writable (`gateway models quantize`, the image's tools target) and serve that folder"
        ) from exc
    return result


def ensure_int8(
    models_dir: Path, profile: ModelProfile, onnx_path: Path, photos: Path | None, *, force: bool = False
) -> Path:
    """The INT8 model for ``onnx_path``: cached when built from the same file (and, with ``photos``,
    the same photos), else quantised from ``photos``. Without photos and without a cached model,
    ``QuantizationRefused`` says how to get one. On a CPU without VNNI it refuses outright: int8
    dot products there saturate, and even with NNCF's overflow fix on every layer the model fell
    short of the agreement bar (measured on an AVX2-only AMD EPYC: 93 % top-1 agreement with FP32 on
    215 photos with a clear answer, against 99 % required), whether built there or elsewhere."""
    if not has_vnni():
        raise QuantizationRefused(
            "this CPU has no VNNI instructions: INT8 models lose too much accuracy on it (93 % top-1 agreement "
            f"with FP32 measured on an AVX2-only CPU, {MIN_AGREEMENT:.0%} required); serve fp32 or bf16"
        )
    path = int8_path(models_dir, profile)
    meta_path = path.parent / "build.json"
    onnx_sha = recorded_sha256(onnx_path) or hashlib.sha256(onnx_path.read_bytes()).hexdigest()
    stored = json.loads(meta_path.read_text()) if meta_path.exists() and path.exists() else None
    if photos is None:
        if stored is not None and stored.get("onnx_sha256") == onnx_sha:
            return path
        raise QuantizationRefused(
            f"no INT8 model for {profile.name} in {models_dir}: set GATEWAY_CALIBRATION_DIR to a folder of "
            f"photos like the traffic (at least {MIN_PHOTOS}), or run `gateway models quantize --photos DIR`"
        )
    import nncf
    import openvino as ov

    paths = photos_in(photos)
    fingerprint = {
        "model": profile.name,
        "onnx_sha256": onnx_sha,
        "photos_sha256": _digest(paths),
        "nncf": nncf.__version__,
        "openvino": ov.__version__,
    }
    if not force and stored is not None and {k: stored.get(k) for k in fingerprint} == fingerprint:
        return path
    logger.info("quantizing %s to INT8 on %d photos from %s", profile.name, len(paths), photos)
    result = quantize(onnx_path, model_inputs(paths, profile), path, {**fingerprint, "photos": len(paths)})
    logger.info("quantized %s: %s on held-out photos", profile.name, result)
    return path
