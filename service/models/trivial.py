"""A model with the gateway's input/output contract and almost no compute: channel means of a
sparse grid of pixels (every 8th row and column) through a fixed 3x1000 projection and a softmax.
For measuring the gateway and Triton themselves (the "gateway-bound" case of the benchmarks), never
for real answers: it costs the process that runs it ~1/64 of the pixels, as a model on a GPU would
cost the gateway's CPU nothing. (Revision 1 cast and normalised every pixel: about 0.3 ms of CPU per
image, as much as decoding a 224 px JPEG.)"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from service.models.graph import GraphBuilder
from service.models.tensors import INPUT_NAME

GRID_STEP = 8


def build(image_size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder()
    starts, ends, axes, steps = ((0, 0), (image_size, image_size), (1, 2), (GRID_STEP, GRID_STEP))
    grid = [g.constant("slice", np.asarray(v, np.int64)) for v in (starts, ends, axes, steps)]
    x = g.op("Slice", [INPUT_NAME, *grid])  # [N, H/8, W/8, 3]
    x = g.op("Cast", [x], to=TensorProto.FLOAT)
    x = g.op("ReduceMean", [x], axes=[1, 2], keepdims=0)  # [N, 3] in [0, 255]
    x = g.op("Sub", [x, g.constant("mean", np.full((1, 3), 127.5, np.float32))])
    x = g.op("Mul", [x, g.constant("inv_std", np.full((1, 3), 1 / 127.5, np.float32))])  # in [-1, 1]
    weights = np.random.default_rng(0).standard_normal((3, classes)).astype(np.float32)
    x = g.op("MatMul", [x, g.constant("proj", weights)])
    out = g.op("Softmax", [x], axis=1)
    return g.finish(out, name="trivial", image_size=image_size, classes=classes)
