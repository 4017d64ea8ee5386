"""The Classifier's offline checks: bounded, and never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import service.classifier as classifier_module
from service.batching.batcher import DynamicBatcher
from service.classifier import Classifier, ImageInput
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
