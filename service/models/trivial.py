"""A model with the gateway's input/output contract and almost no compute: per-image channel means
through a fixed 3x1000 projection and a softmax. For measuring the gateway and Triton themselves
(the "gateway-bound" case of the benchmarks), never for real answers."""

from __future__ import annotations

import numpy as np
import onnx

from service.models.graph import INPUT_NAME, GraphBuilder


def build(image_size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder()
    x = g.normalise_uint8_nhwc(INPUT_NAME, (127.5,) * 3, (127.5,) * 3)  # NCHW in [-1, 1]
    x = g.op("GlobalAveragePool", [x])
    x = g.op("Flatten", [x], axis=1)
    weights = np.random.default_rng(0).standard_normal((3, classes)).astype(np.float32)
    x = g.op("MatMul", [x, g.constant("proj", weights)])
    out = g.op("Softmax", [x], axis=1)
    return g.finish(out, name="trivial", image_size=image_size, classes=classes)
