"""The contract every backend meets, and the batch buffer backends assemble their input in."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

Images = Sequence[np.ndarray] | np.ndarray
"""A batch as the batcher hands it over: N uint8 ``[H, W, 3]`` RGB images, each its own array (or,
from callers that already have one, a stacked ``[N, H, W, 3]`` array)."""


class Backend(Protocol):
    name: str
    """Short name used in logs, metrics and /readyz (``embedded``, ``triton``...)."""

    async def start(self) -> None:
        """Open connections or load the model; called once by the app's lifespan."""

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        """N uint8 ``[H, W, 3]`` RGB images to ``float32 [N, classes]`` probabilities.

        The backend lays the images out as its model wants them (``BatchBuffer``, or straight into a
        shared-memory region), where it wants (off the event loop when it can).

        ``timeout`` is the seconds left before the last request of the batch passes its deadline; a
        backend that can abandon a call should give up then. Raise ``service.errors.GatewayError``
        subclasses for failures the client should see."""
        ...

    async def ready(self) -> str | None:
        """None when ready to serve, otherwise why not."""
        ...

    async def aclose(self) -> None:
        """Release what ``start`` opened; called once at shutdown."""


class BatchBuffer:
    """One ``[N, H, W, 3]`` array per thread, reused batch after batch, that a batch's images are
    copied into: one copy per image, into memory already mapped. ``np.stack`` would allocate a fresh
    batch each time, and a fresh multi-megabyte array costs a page fault per 4 KiB on first touch
    (on the event loop that was a tenth of the serving path's time).

    The array returned by ``assemble`` is valid until the same thread's next call: a backend uses it
    for one synchronous call (ONNX Runtime's ``run``, a protobuf or shared-memory copy) and drops it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def assemble(self, images: Images) -> np.ndarray:
        if isinstance(images, np.ndarray):  # stacked already
            return images
        first = images[0]
        buffer: np.ndarray | None = getattr(self._local, "array", None)
        if (
            buffer is None
            or buffer.shape[0] < len(images)
            or buffer.shape[1:] != first.shape
            or buffer.dtype != first.dtype
        ):
            rows = max(len(images), 0 if buffer is None else buffer.shape[0])
            buffer = self._local.array = np.empty((rows, *first.shape), first.dtype)
        batch = buffer[: len(images)]
        np.stack(images, out=batch)  # ValueError if the images differ in shape
        return batch
