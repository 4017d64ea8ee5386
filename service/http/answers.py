"""The online answers of the image routes, rendered by hand for speed: ``/classify``'s labels and
``/embed``'s vectors as JSON, or the vectors as little-endian float32 rows when the client asks for
``application/octet-stream``.

A float32 is written with 9 significant digits (``%.9g``), the fewest that always give the same
float32 back: for a 1,280-number vector that is 15.6 KB and 0.4 ms of the event loop, against
26.4 KB and 0.8 ms for ``json.dumps`` of the row's doubles; the binary rows are 5 KB in 1 us."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from service.classifier import Classification, ImageInput
from service.schemas import ModelInfo

BINARY = "application/octet-stream"
EMBEDDING_SHAPE = "X-Embedding-Shape"
"""Header of a binary ``/embed`` answer: ``N,D``, its images and each vector's numbers."""
MODEL_NAME = "X-Model-Name"
MODEL_VERSION = "X-Model-Version"
"""Headers of a binary ``/embed`` answer: the model and the version that answered."""


class Answers:
    """Renders one model version's answers in the shape of ``schemas.ClassifyResponse`` and
    ``schemas.EmbedResponse`` (which document them), as compact JSON, with the model and the labels
    encoded once: building and validating the pydantic models, or ``json.dumps`` of the nested
    dicts, cost more than the rest of the route."""

    def __init__(self, model: ModelInfo, labels: Sequence[str]) -> None:
        self.model = model
        self._model_json = model.model_dump_json()
        self._labels_json = [json.dumps(label) for label in labels]

    def render(self, results: list[Classification]) -> bytes:
        """Scores are finite (the batcher fails NaN/inf rows) and ``repr`` is how ``json`` writes floats."""
        labels = self._labels_json
        parts = []
        for result in results:
            ranked = ",".join(f'{{"index":{i},"label":{labels[i]},"score":{s!r}}}' for i, _, s in result.labels)
            parts.append(f'{{"filename":{json.dumps(result.filename)},"labels":[{ranked}]}}')
        return f'{{"model":{self._model_json},"results":[{",".join(parts)}]}}'.encode()

    def render_embeddings(self, images: list[ImageInput], vectors: list[np.ndarray]) -> bytes:
        """Each image's vector, float32 in 9 significant digits (finite: the batcher fails NaN/inf rows)."""
        parts = [
            f'{{"filename":{json.dumps(image.filename)},"vector":[{",".join(map("%.9g".__mod__, vector.tolist()))}],'
            f'"dimensions":{len(vector)}}}'
            for image, vector in zip(images, vectors, strict=True)
        ]
        return f'{{"model":{self._model_json},"embeddings":[{",".join(parts)}]}}'.encode()

    def embedding_headers(self, vectors: list[np.ndarray]) -> dict[str, str]:
        """What a binary answer says beside its rows: their shape, and who answered."""
        width = len(vectors[0]) if vectors else 0
        return {
            EMBEDDING_SHAPE: f"{len(vectors)},{width}",
            MODEL_NAME: self.model.name,
            MODEL_VERSION: self.model.version,
        }


def embedding_rows(vectors: list[np.ndarray]) -> bytes:
    """The vectors as one block of little-endian float32 rows, in the order of the images."""
    return np.stack(vectors).astype("<f4", copy=False).tobytes() if vectors else b""


def wants_binary(accept: str | None) -> bool:
    """Whether ``Accept`` prefers ``application/octet-stream`` to JSON: listed with a weight over 0,
    and over JSON's weight where it lists JSON too (a tie: the one listed first). Anything else,
    ``*/*`` or no header at all, gets JSON."""
    if not accept or BINARY not in accept:  # the common case: no parsing
        return False
    weights: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        weight = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weight = weight if 0.0 <= weight <= 1.0 else 0.0  # nan and out-of-range weights refuse the type
        weights.setdefault(media.lower(), weight)
    binary = weights.get(BINARY, 0.0)
    json_weight = weights.get("application/json", -1.0)
    if binary <= 0.0:
        return False
    if binary != json_weight:
        return binary > json_weight
    return list(weights).index(BINARY) < list(weights).index("application/json")
