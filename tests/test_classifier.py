"""The Classifier's offline checks: bounded, and never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest

import service.classifier as classifier_module
from service.batching.batcher import DynamicBatcher
from service.classifier import Classifier, ImageInput, UnexpectedOutput, rank_for
from service.errors import BadImage
from service.images.imageinfo import ImageInfo, probe
from service.images.preprocess import PreprocessConfig
from service.metrics import Metrics
from service.models.profiles import get_profile


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


async def test_rows_wider_than_the_labels_are_a_backend_error_naming_both_widths(
    tmp_path: Path, cat_jpeg: bytes
) -> None:
    """A model whose output width is dynamic in its file (``[N, "D"]``) was declared with 10 labels
    and gives 12 numbers: /classify answers a 502 backend_error naming the model and both widths,
    never an IndexError (a 500) from the labels; a model giving what was declared answers."""
    import onnxruntime as ort

    from service.models.declaration import parse_declaration
    from service.models.reading import complete
    from service.models.store import ensure_model
    from tests.models.exports import tiny_model

    for outputs in (12, 10):
        onnx.save(tiny_model(["N", 3, 8, 8], outputs=outputs, out_shape=["N", "D"]), tmp_path / "m.onnx")
        labels = [f"l{i}" for i in range(10)]
        declared = parse_declaration({"path": "m.onnx", "labels": labels}, "w", base=tmp_path, root=None)
        profile = complete(declared, name="cars", version="1", max_batch_size=4)
        session = ort.InferenceSession(str(ensure_model(tmp_path / "models", profile, force=True)))

        async def infer(batch: np.ndarray, timeout: float | None = None) -> np.ndarray:
            return session.run(None, {"images": batch})[0]  # noqa: B023 (awaited within the iteration)

        batcher = DynamicBatcher(
            infer, max_batch_size=4, max_delay=0, max_queue_size=4, max_inflight_batches=1, rank=rank_for(profile)
        )
        batcher.start()
        pool = ThreadPoolExecutor(1)
        classifier = Classifier(profile, batcher, pool, Metrics(), PreprocessConfig(8, 8))
        try:
            if outputs == 12:
                with pytest.raises(UnexpectedOutput) as caught:
                    await classifier.classify([ImageInput(cat_jpeg)], k=20, deadline=None)
                error = caught.value
                assert (error.status_code, error.error) == (502, "backend_error")
                assert "model 'cars' version 1 gave 12 numbers" in error.detail
                assert "checked at start for 10 (its 10 labels)" in error.detail
            else:
                (answer,) = await classifier.classify([ImageInput(cat_jpeg)], k=3, deadline=None)
                assert [label for _, label, _ in answer.labels] == ["l9", "l8", "l7"]
        finally:
            await batcher.aclose()
            pool.shutdown()
