"""A small ONNX graph builder for inference-only CNNs.

BatchNorm is folded into the preceding convolution at build time, and the image normalisation is
part of the graph: every model built here takes ``uint8`` RGB images in NHWC layout, named
``images`` with shape ``[N, H, W, 3]``, and returns softmax probabilities named ``scores``
with shape ``[N, classes]``. Keeping uint8 on the wire costs 150 KB per 224x224 image instead of
602 KB for float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from service.models.tensors import INPUT_NAME, OUTPUT_NAME

OPSET = 17


class GraphBuilder:
    """Accumulates nodes and initialisers; each method returns the name of its output tensor."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counter = 0

    def _name(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    def constant(self, prefix: str, value: np.ndarray) -> str:
        name = self._name(prefix)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], **attrs: Any) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def normalise_uint8_nhwc(self, x: str, mean: Sequence[float], std: Sequence[float]) -> str:
        """uint8 NHWC in [0, 255] -> float32 NCHW, ``(x - mean) / std`` per channel."""
        x = self.op("Cast", [x], to=TensorProto.FLOAT)
        x = self.op("Transpose", [x], perm=[0, 3, 1, 2])
        mean_t = self.constant("mean", np.asarray(mean, np.float32).reshape(1, 3, 1, 1))
        scale_t = self.constant("inv_std", (1.0 / np.asarray(std, np.float32)).reshape(1, 3, 1, 1))
        x = self.op("Sub", [x, mean_t])
        return self.op("Mul", [x, scale_t])

    def conv_bn(
        self,
        x: str,
        weight: np.ndarray,
        bn: dict[str, np.ndarray],
        *,
        stride: int = 1,
        groups: int = 1,
        eps: float,
    ) -> str:
        """Convolution without bias followed by inference-mode BatchNorm, folded into one Conv."""
        scale = bn["weight"] / np.sqrt(bn["running_var"] + eps)
        folded_w = (weight * scale.reshape(-1, 1, 1, 1)).astype(np.float32)
        folded_b = (bn["bias"] - bn["running_mean"] * scale).astype(np.float32)
        k = weight.shape[-1]
        pad = (k - 1) // 2
        return self.op(
            "Conv",
            [x, self.constant("w", folded_w), self.constant("b", folded_b)],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad, pad, pad, pad],
            group=groups,
        )

    def relu6(self, x: str) -> str:
        lo = self.constant("zero", np.array(0.0, np.float32))
        hi = self.constant("six", np.array(6.0, np.float32))
        return self.op("Clip", [x, lo, hi])

    def classifier(self, x: str, weight: np.ndarray, bias: np.ndarray) -> str:
        """Global average pool, fully connected layer, softmax."""
        x = self.op("GlobalAveragePool", [x])
        x = self.op("Flatten", [x], axis=1)
        x = self.op(
            "Gemm",
            [x, self.constant("fc_w", weight.astype(np.float32)), self.constant("fc_b", bias.astype(np.float32))],
            transB=1,
        )
        return self.op("Softmax", [x], axis=1)

    def finish(self, output: str, *, name: str, image_size: int, classes: int) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Identity", [output], [OUTPUT_NAME]))
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", image_size, image_size, 3])],
            [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", classes])],
            self.initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="inference-gateway"
        )
        model.ir_version = 8  # readable by every ONNX Runtime and Triton release in use
        onnx.checker.check_model(model, full_check=True)
        return model


def bn_params(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The four BatchNorm tensors stored under ``prefix`` (e.g. ``layer1.0.bn1``)."""
    return {k: state[f"{prefix}.{k}"] for k in ("weight", "bias", "running_mean", "running_var")}
