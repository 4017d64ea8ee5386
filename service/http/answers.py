"""The online answer of ``POST /classify``, rendered as JSON by hand for speed."""

from __future__ import annotations

import json
from collections.abc import Sequence

from service.classifier import Classification
from service.schemas import ModelInfo


class Answers:
    """Renders classifications in the shape of ``schemas.ClassifyResponse`` (which documents it),
    as compact JSON, with the model and the labels encoded once: building and validating the
    pydantic models, or ``json.dumps`` of the nested dicts, cost more than the rest of the route."""

    def __init__(self, model: ModelInfo, labels: Sequence[str]) -> None:
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
