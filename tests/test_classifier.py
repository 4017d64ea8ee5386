"""The Classifier's offline checks: bounded, and never on the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import service.classifier as classifier_module
from service.batching.batcher import DynamicBatcher
from service.classifier import Classification, Classifier, ImageInput
from service.errors import BadImage
from service.images.imageinfo import ImageInfo, probe
from service.images.preprocess import PreprocessConfig
from service.metrics import Metrics
from service.models.profiles import get_profile, top_k
from service.schemas import ClassifyResponse


def _unused_batcher() -> DynamicBatcher:
    """A batcher these tests never start (they check decoding and encoding only)."""
    return DynamicBatcher(
        lambda batch, timeout=None: asyncio.sleep(0),
        max_batch_size=1,
        max_delay=0,
        max_queue_size=1,
        max_inflight_batches=1,
    )


async def test_offline_validation_runs_in_the_thread_pool(monkeypatch: pytest.MonkeyPatch, cat_jpeg: bytes) -> None:
    """mode=offline probes headers in the preprocessing pool: a hostile header must never hold the
    event loop (it used to, freezing /healthz for the whole walk)."""
    threads: list[str] = []

    def recording_probe(data: bytes) -> ImageInfo:
        threads.append(threading.current_thread().name)
        return probe(data)

    monkeypatch.setattr(classifier_module, "probe", recording_probe)
    pool = ThreadPoolExecutor(1, thread_name_prefix="preprocess")
    batcher = _unused_batcher()
    classifier = Classifier(get_profile("trivial"), batcher, pool, Metrics(), PreprocessConfig())
    try:
        await classifier.validate([ImageInput(cat_jpeg), ImageInput(cat_jpeg)])
        with pytest.raises(BadImage) as refused:
            await classifier.validate([ImageInput(cat_jpeg), ImageInput(b"\xff\xd8" + b"\xff" * 4096)])
        assert refused.value.detail.startswith("image 2 of 2: corrupt JPEG: more than 64 fill bytes")
    finally:
        pool.shutdown()
    assert threads
    assert all(name.startswith("preprocess") for name in threads), threads


@pytest.mark.parametrize("filename", [None, 'cat "1".jpg', "kätzchen\n.png"])
def test_the_online_answer_is_the_documented_json(filename: str | None) -> None:
    """The answer written by hand (for speed) is exactly what the documented response model, or
    ``json.dumps`` of the same values, would give: quoting, escapes and float digits included."""
    profile = get_profile("resnet50")  # real ImageNet labels, some with quotes and commas
    batcher = _unused_batcher()
    classifier = Classifier(profile, batcher, ThreadPoolExecutor(1), Metrics(), PreprocessConfig())
    rng = np.random.default_rng(3)
    results = []
    for _ in range(3):
        row = rng.random(1000).astype(np.float32) * rng.choice([1e-9, 1.0, 1e6])
        results.append(Classification(filename, [(i, profile.labels[i], s) for i, s in top_k(row, 5)]))
    text = classifier.answer_json(results)
    expected = ClassifyResponse(
        model=classifier.model_info,
        results=[
            {"filename": r.filename, "labels": [{"index": i, "label": lab, "score": s} for i, lab, s in r.labels]}
            for r in results
        ],  # type: ignore[misc]
    )
    assert json.loads(text) == expected.model_dump()
    assert json.loads(text) == json.loads(json.dumps(expected.model_dump()))
    assert [lab["score"] for lab in json.loads(text)["results"][0]["labels"]] == [s for _, _, s in results[0].labels]
