"""The embedded backend: ONNX Runtime on CPU inside the gateway's process (PAPER.md's "simple"
architecture). ``InferenceSession.run`` releases the GIL and is thread-safe, so batches run in a
small dedicated thread pool, one thread per batch allowed in flight."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.backends.base import BatchBuffer, Images
from service.errors import BackendError, BackendUnavailable
from service.models.graph import INPUT_NAME, OUTPUT_NAME

logger = logging.getLogger(__name__)


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, model_path: Path, *, intra_op_threads: int = 0, max_concurrency: int = 1) -> None:
        self._model_path = model_path
        self._intra_op_threads = intra_op_threads
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="onnxruntime")
        self._session: ort.InferenceSession | None = None
        self._load_error: str | None = None
        self._buffer = BatchBuffer()

    def _load(self) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._intra_op_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(str(self._model_path), options, providers=["CPUExecutionProvider"])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._session = await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:  # a broken model file keeps the process up but not ready
            self._load_error = f"model {self._model_path} failed to load: {exc}"
            logger.exception("embedded backend: could not load %s", self._model_path)
            return
        logger.info("embedded backend: loaded %s", self._model_path)

    def _run(self, images: Images) -> np.ndarray:
        """In the backend's thread: the batch is assembled here, not on the event loop."""
        assert self._session is not None
        (scores,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: self._buffer.assemble(images)})
        return np.asarray(scores)

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        if self._session is None:
            raise BackendUnavailable(self._load_error or "embedded model is not loaded")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._run, images)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument) as exc:
            raise BackendError(f"ONNX Runtime failed: {exc}") from exc

    async def ready(self) -> str | None:
        if self._session is None:
            return self._load_error or "model is loading"
        return None

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._session = None
