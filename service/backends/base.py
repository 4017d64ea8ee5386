"""The contract every backend meets (its optional parts with their defaults in ``BackendDefaults``),
and the batch buffer backends assemble their input in."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import cv2
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

    @property
    def detail(self) -> str | None:
        """What runs the model, for ``/readyz`` (a runtime, a precision, any fallback it took), or None."""
        ...

    def liveness(self) -> str | None:
        """Why this process is not live and a restart may help (the shared engine gone too long), or None."""
        ...

    def allocate_image(self) -> np.ndarray | None:
        """Memory of the backend's own to decode one image into (then its batch is sent with no copy),
        or None: a new array. Any thread."""
        ...


class BackendDefaults:
    """The optional parts of ``Backend`` as a backend without them has them: no detail, always live,
    no memory of its own for images. Every backend inherits it and overrides what it has."""

    detail: str | None = None

    def liveness(self) -> str | None:
        return None

    def allocate_image(self) -> np.ndarray | None:
        return None


def _numpy_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    return np.empty(shape, dtype)


def stack_into(out: np.ndarray, images: Images) -> None:
    """The images copied into ``out`` (``[N, H, W, C]``, N = the number of images), one copy each;
    ValueError if they differ in shape from it.

    uint8 images (the batcher's) are copied by one ``cv2.vconcat`` into ``out`` seen as one tall
    image: a single call that releases the GIL once for the whole batch. ``np.stack`` releases and
    takes back the GIL once per image, and a backend thread that wants the GIL back while the event
    loop holds it waits its turn each time. On the serving path, one call brought the mean batch's
    backend time from 4.2 to 2.4 ms."""
    if isinstance(images, np.ndarray):  # stacked already
        out[...] = images
        return
    if out.dtype != np.uint8 or out.ndim != 4 or out.shape[3] > 4 or not out.flags.c_contiguous:
        np.stack(images, out=out)
        return
    if len(images) != len(out) or any(image.shape != out.shape[1:] or image.dtype != out.dtype for image in images):
        raise ValueError(
            f"a batch needs images of the same shape, {out.shape[1:]}; got {sorted({i.shape for i in images})}"
        )
    tall = out.reshape(-1, *out.shape[2:])
    if cv2.vconcat(list(images), dst=tall) is not tall:  # written elsewhere: never, for a buffer that fits
        raise RuntimeError("cv2.vconcat did not write into the batch buffer")


class BatchBuffer:
    """One ``[N, H, W, 3]`` array per thread, reused batch after batch, that a batch's images are
    copied into: one copy per image, into memory already mapped. ``np.stack`` would allocate a fresh
    batch each time, and a fresh multi-megabyte array costs a page fault per 4 KiB on first touch
    (on the event loop that was a tenth of the serving path's time).

    ``allocate(shape, dtype)`` makes the arrays (default ``np.empty``; the torch backend's are
    page-locked, so the copy to the GPU is asynchronous).

    The array returned by ``assemble`` is valid until the same thread's next call: a backend uses it
    for one synchronous call (ONNX Runtime's ``run``, a protobuf or shared-memory copy) and drops it."""

    def __init__(self, allocate: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] = _numpy_empty) -> None:
        self._allocate = allocate
        self._local = threading.local()

    def assemble(self, images: Images, rows: int | None = None) -> np.ndarray:
        """The images as one batch. With ``rows`` (at least the number of images) the batch has that
        many rows, the ones past the images holding whatever an earlier batch left there: a backend
        that runs a few fixed batch shapes pads its batches so, and drops those rows' answers."""
        rows = rows or len(images)
        if isinstance(images, np.ndarray) and len(images) == rows:  # stacked already
            return images
        first = images[0]
        buffer: np.ndarray | None = getattr(self._local, "array", None)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != first.shape or buffer.dtype != first.dtype:
            size = max(rows, 0 if buffer is None else buffer.shape[0])
            buffer = self._local.array = self._allocate((size, *first.shape), first.dtype)
        stack_into(buffer[: len(images)], images)
        return buffer[:rows]
