"""The job both peer servers do, apart from serving: a photo to the model's input the way the
gateway makes it, the ONNX Runtime session, and a score row to the top 5 labels.

Runs in the peers' own environments (numpy, OpenCV, ONNX Runtime; not this project): nothing here
imports ``service``. The pixels are the gateway's (``service.images.preprocess`` with the
``efficientnet-lite0`` profile: 224 x 224, crop fraction 0.875): a JPEG large enough is decoded by
libjpeg at 1/2, 1/4 or 1/8 scale, never so small that the crop would be enlarged; the centre square
of ``round(0.875 x shorter side)`` is resized once to 224 px (INTER_AREA shrinking, INTER_LINEAR
enlarging), decoded straight to RGB. One difference: EXIF orientation is ignored here (the gateway
applies it); the benchmark's photos carry none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort

SIZE = 224
CROP_FRACTION = 0.875
INPUT_NAME = "images"
OUTPUT_NAME = "scores"
TOP_K = 5

_REDUCED = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))
_RGB = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION


class BadPhoto(ValueError):
    """The body is not an image OpenCV can decode."""


@dataclass(frozen=True)
class Config:
    """What ``loadtests.harness.peers`` hands a peer through its environment."""

    model: Path
    labels: Path
    threads: int
    """ONNX Runtime intra-op threads."""
    max_batch: int
    max_wait_s: float
    timeout_s: float
    """How long a request may wait for its answer (the gateway's ``request_timeout``)."""

    @classmethod
    def from_env(cls) -> Config:
        env = os.environ
        return cls(
            model=Path(env["PEER_MODEL"]),
            labels=Path(env["PEER_LABELS"]),
            threads=int(env.get("PEER_THREADS", "0")),
            max_batch=int(env.get("PEER_MAX_BATCH", "16")),
            max_wait_s=float(env.get("PEER_MAX_WAIT_S", "0.005")),
            timeout_s=float(env.get("PEER_TIMEOUT_S", "10")),
        )


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header; None for anything else."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            return int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def _crop_side(height: int, width: int) -> int:
    return max(1, round(CROP_FRACTION * min(height, width)))


def _decode_flag(data: bytes) -> int:
    """The smallest JPEG scale whose crop still covers 224 px (the gateway's ``reduction_for``)."""
    size = jpeg_size(data)
    if size is not None:
        height, width = size
        for factor, flag in _REDUCED:
            if height // factor and width // factor and _crop_side(height // factor, width // factor) >= SIZE:
                return (flag & ~cv2.IMREAD_COLOR) | _RGB
    return _RGB


def prepare(data: bytes) -> np.ndarray:
    """Encoded photo to the model's input: uint8 RGB (224, 224, 3)."""
    img = cv2.imdecode(np.frombuffer(data, np.uint8), _decode_flag(data))
    if img is None or img.size == 0:
        raise BadPhoto("the body could not be decoded as an image")
    height, width = img.shape[:2]
    side = min(height, width, _crop_side(height, width))
    y, x = (height - side) // 2, (width - side) // 2
    interpolation = cv2.INTER_AREA if side > SIZE else cv2.INTER_LINEAR
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    cv2.resize(img[y : y + side, x : x + side], (SIZE, SIZE), dst=out, interpolation=interpolation)
    return out


def open_session(config: Config) -> ort.InferenceSession:
    """The model on ONNX Runtime's CPU provider, with the gateway's embedded backend's options."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = config.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(config.model), options, providers=["CPUExecutionProvider"])


def infer(session: ort.InferenceSession, batch: np.ndarray) -> np.ndarray:
    """Score rows, float32 [N, 1000], for a uint8 batch [N, 224, 224, 3]."""
    (scores,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
    return np.asarray(scores)


def read_labels(path: Path) -> list[str]:
    return path.read_text().splitlines()


def top5(scores: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    """The five best labels of one score row, best first."""
    best = np.argpartition(scores, -TOP_K)[-TOP_K:]
    best = best[np.argsort(-scores[best], kind="stable")]
    return [{"index": int(i), "label": labels[i], "score": float(scores[i])} for i in best]
