"""A backend alone, in this process, on decoded tensors: its scores (to compare runtimes and
precisions) and its rate at a batch size, with no HTTP, decode or batching in front of it."""

from __future__ import annotations

import time

import numpy as np

from service.backends.inprocess import InProcessBackend


async def scores_of(backend: InProcessBackend, images: np.ndarray) -> np.ndarray:
    """Every image's scores, 16 at a time, from ``backend`` started for the purpose and closed after."""
    await backend.start()
    try:
        if problem := await backend.ready():
            raise RuntimeError(f"{backend.name} backend not ready: {problem}")
        return np.concatenate([await backend.infer(images[i : i + 16]) for i in range(0, len(images), 16)])
    finally:
        await backend.aclose()


async def backend_rate(backend: InProcessBackend, images: np.ndarray, batch: int, seconds: float) -> float:
    """Images per second through ``backend`` alone, called with ``batch`` images at a time for ``seconds``."""
    await backend.start()
    try:
        await backend.infer(images[:batch])  # warm-up
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            offset = (done % (len(images) - batch)) if len(images) > batch else 0
            await backend.infer(images[offset : offset + batch])
            done += batch
        return done / (time.perf_counter() - start)
    finally:
        await backend.aclose()
