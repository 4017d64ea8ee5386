"""The embedded backend: ONNX Runtime on CPU inside the gateway's process (the study's (docs/study.md) "simple"
architecture). ``InferenceSession.run`` releases the GIL and is thread-safe, so one session serves
every in-flight batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.backends.inprocess import InProcessBackend
from service.models.tensors import INPUT_NAME, OUTPUT_NAME


class EmbeddedBackend(InProcessBackend):
    name = "embedded"
    runtime_errors = (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument)

    def __init__(self, model_path: Path, *, intra_op_threads: int = 0, max_concurrency: int = 1) -> None:
        super().__init__(model_path, max_concurrency=max_concurrency)
        self._intra_op_threads = intra_op_threads
        self._session: ort.InferenceSession | None = None

    def _load(self) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._intra_op_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(self._model_path), options, providers=["CPUExecutionProvider"])
        self.detail = "ONNX Runtime, fp32"

    def _infer_batch(self, batch: np.ndarray) -> np.ndarray:
        assert self._session is not None
        (scores,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: batch})
        return np.asarray(scores)

    def _close(self) -> None:
        self._session = None
