"""Triton Python-backend model: ONNX Runtime on CPU behind Triton's dynamic batcher.

Copied as ``model.py`` into a repository's model directory, next to the version folder that holds
``model.onnx``. It runs inside Triton's Python stub, so it imports only numpy, onnxruntime and
Triton's ``triton_python_backend_utils``. Parameters (config.pbtxt ``parameters``):
``intra_op_threads`` (ONNX Runtime threads per execution, 0 = its default).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

INPUT_NAME = "images"
OUTPUT_NAME = "scores"


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(params.get("intra_op_threads", "0"))
        options.inter_op_num_threads = 1
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def execute(self, requests: list[Any]) -> list[Any]:
        """Run every request Triton batched together as one ONNX Runtime call, then split."""
        arrays = [pb_utils.get_input_tensor_by_name(r, INPUT_NAME).as_numpy() for r in requests]
        try:
            (scores,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.concatenate(arrays)})
        except Exception as exc:  # every request of the batch gets the error
            error = pb_utils.TritonError(f"onnxruntime failed: {exc}")
            return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]
        responses, start = [], 0
        for array in arrays:
            part = scores[start : start + array.shape[0]]
            start += array.shape[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(OUTPUT_NAME, part)]))
        return responses
