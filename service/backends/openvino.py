"""The OpenVINO backend: the same model, converted for the CPU it runs on (the study's pipeline:
TensorRT on NVIDIA, OpenVINO on Intel), inside the gateway's process like the embedded backend.

Precisions: ``fp32``; ``bf16`` (the CPU plugin's bfloat16 kernels, where the CPU has them: AVX-512
BF16 or AMX; elsewhere it falls back to fp32 and says so in ``/readyz``); ``int8`` (a model
quantised after training by ``service.models.quantize``, calibrated on photos; the layers left in
floating point run in bf16 where the CPU has it, which is what makes int8 faster than bf16 here: see
docs/performance/precision.md). One compiled model serves every in-flight batch,
each thread with its own infer request; ``infer`` releases the GIL.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Literal

import numpy as np
import openvino as ov

from service.backends.inprocess import InProcessBackend
from service.host.cpus import has_bf16

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "int8"]


class OpenVINOBackend(InProcessBackend):
    name = "openvino"
    runtime_errors = (RuntimeError,)

    def __init__(
        self, model_path: Path, *, precision: Precision = "bf16", threads: int = 0, max_concurrency: int = 1
    ) -> None:
        super().__init__(model_path, max_concurrency=max_concurrency)
        self.precision = precision
        self._threads = threads
        self._streams = max_concurrency
        self._compiled: ov.CompiledModel | None = None
        self._requests = threading.local()

    def _load(self) -> None:
        core = ov.Core()
        hint = "f32"
        detail = f"OpenVINO {ov.__version__.split('-')[0]}, {self.precision}"
        if self.precision in ("bf16", "int8"):  # int8: the layers left in floating point run in bf16
            if has_bf16(core):
                hint = "bf16"
            elif self.precision == "bf16":
                detail += " asked for; running fp32: this CPU has no bf16 kernels"
                logger.warning("openvino backend: this CPU has no bf16 kernels; running fp32")
        config: dict[str, object] = {"INFERENCE_PRECISION_HINT": hint, "NUM_STREAMS": self._streams}
        if self._threads:
            config["INFERENCE_NUM_THREADS"] = self._threads * self._streams
        self._compiled = core.compile_model(core.read_model(self._model_path), "CPU", config)
        self.detail = detail

    def _infer_batch(self, batch: np.ndarray) -> np.ndarray:
        request: ov.InferRequest | None = getattr(self._requests, "request", None)
        if request is None:
            assert self._compiled is not None
            request = self._requests.request = self._compiled.create_infer_request()
        request.infer({0: batch}, share_inputs=True)
        return np.array(request.get_output_tensor(0).data)  # a copy: the request reuses its output

    def _close(self) -> None:
        self._compiled = None
