"""What the in-process backends share (the study's (docs/study.md) "simple" architecture: the model runs inside the
gateway's process): the model is loaded and batches run in a small dedicated thread pool, one thread
per batch allowed in flight, so the event loop never waits on inference. The runtimes used here
(ONNX Runtime, OpenVINO) release the GIL while they compute.

A model that fails to load keeps the process up but not ready, with the reason in ``/readyz``; the
model's path and the runtime's message (which names the path) are for the log only."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from service.backends.base import BackendDefaults, BatchBuffer, Images
from service.errors import BackendError, BackendUnavailable

logger = logging.getLogger(__name__)


class InProcessBackend(BackendDefaults):
    name = "in-process"
    runtime_errors: tuple[type[Exception], ...] = ()
    """Errors of the runtime that mean "this batch failed" (502), not "the gateway is broken"."""

    def __init__(self, model_path: Path, *, max_concurrency: int = 1) -> None:
        self._model_path = model_path
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=self.name)
        self._loaded = False
        self._load_error: str | None = None
        self._buffer = BatchBuffer()
        self.detail: str | None = None
        """What runs the model, for ``/readyz`` (e.g. a precision, and any fallback taken)."""

    def _load(self) -> None:
        """Load the model (in the backend's thread); raise if it cannot be served."""
        raise NotImplementedError

    def _infer_batch(self, batch: np.ndarray) -> np.ndarray:
        """Run one ``[N, H, W, 3]`` uint8 batch (in one of the backend's threads)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Drop the model."""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:
            self._load_error = f"the model failed to load ({type(exc).__name__}; the gateway's log says why)"
            logger.exception("%s backend: could not load %s", self.name, self._model_path)
            return
        self._loaded = True
        logger.info("%s backend: model loaded%s", self.name, f" ({self.detail})" if self.detail else "")
        logger.debug("%s backend: loaded %s", self.name, self._model_path)

    def _run(self, images: Images) -> np.ndarray:
        """In the backend's thread: the batch is assembled here, not on the event loop."""
        return self._infer_batch(self._buffer.assemble(images))

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        if not self._loaded:
            raise BackendUnavailable(self._load_error or f"{self.name} model is not loaded")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._run, images)
        except self.runtime_errors as exc:
            logger.warning("%s backend: the runtime failed on a batch: %s", self.name, exc)
            raise BackendError(f"the {self.name} runtime failed on the batch ({type(exc).__name__})") from exc

    async def ready(self) -> str | None:
        if not self._loaded:
            return self._load_error or "model is loading"
        return None

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._loaded = False
        self._close()
