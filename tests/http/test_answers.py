"""The online answer, rendered by hand for speed, is the documented JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.classifier import Classification
from service.http.answers import Answers
from service.models.profiles import get_profile, top_k
from service.schemas import ClassifyResponse, ModelInfo


@pytest.mark.parametrize("filename", [None, 'cat "1".jpg', "kätzchen\n.png"])
def test_the_online_answer_is_the_documented_json(filename: str | None) -> None:
    """The answer written by hand (for speed) is exactly what the documented response model, or
    ``json.dumps`` of the same values, would give: quoting, escapes and float digits included."""
    profile = get_profile("resnet50")  # real ImageNet labels, some with quotes and commas
    model = ModelInfo(name=profile.name, version=profile.version, random_weights=False)
    rng = np.random.default_rng(3)
    results = []
    for _ in range(3):
        row = rng.random(1000).astype(np.float32) * rng.choice([1e-9, 1.0, 1e6])
        results.append(Classification(filename, [(i, profile.labels[i], s) for i, s in top_k(row, 5)]))
    text = Answers(model, profile.labels).render(results)
    expected = ClassifyResponse(
        model=model,
        results=[
            {"filename": r.filename, "labels": [{"index": i, "label": lab, "score": s} for i, lab, s in r.labels]}
            for r in results
        ],  # type: ignore[misc]
    )
    assert json.loads(text) == expected.model_dump()
    assert json.loads(text) == json.loads(json.dumps(expected.model_dump()))
    assert [lab["score"] for lab in json.loads(text)["results"][0]["labels"]] == [s for _, _, s in results[0].labels]
