"""ResNet-50 (torchvision layout and parameter names) as an ONNX graph.

With a torchvision ``state_dict`` the graph classifies like torchvision's model; without one the
weights are random and He-initialised as torchvision initialises them, which gives the production
model's compute profile for load tests (and the source of the Triton/TensorRT model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from service.models.tensors import INPUT_NAME

if TYPE_CHECKING:  # building needs the `models` extra; the torch backend uses only the constants
    import onnx

BN_EPS = 1e-5
LAYERS = (3, 4, 6, 3)
WIDTHS = (64, 128, 256, 512)
EXPANSION = 4
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def random_state_dict(seed: int = 0, classes: int = 1000) -> dict[str, np.ndarray]:
    """torchvision's ResNet-50 parameter names and shapes, He-initialised (fan_out) convolutions,
    identity BatchNorm, uniform fully connected layer."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}

    def conv(name: str, out_ch: int, in_ch: int, k: int) -> None:
        std = np.sqrt(2.0 / (out_ch * k * k))
        state[f"{name}.weight"] = rng.normal(0.0, std, (out_ch, in_ch, k, k)).astype(np.float32)

    def bn(name: str, ch: int) -> None:
        state[f"{name}.weight"] = np.ones(ch, np.float32)
        state[f"{name}.bias"] = np.zeros(ch, np.float32)
        state[f"{name}.running_mean"] = np.zeros(ch, np.float32)
        state[f"{name}.running_var"] = np.ones(ch, np.float32)

    conv("conv1", 64, 3, 7)
    bn("bn1", 64)
    in_ch = 64
    for li, (blocks, width) in enumerate(zip(LAYERS, WIDTHS, strict=True), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            conv(f"{p}.conv1", width, in_ch, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width * EXPANSION, width, 1)
            bn(f"{p}.bn3", width * EXPANSION)
            if b == 0:
                conv(f"{p}.downsample.0", width * EXPANSION, in_ch, 1)
                bn(f"{p}.downsample.1", width * EXPANSION)
            in_ch = width * EXPANSION
    bound = 1.0 / np.sqrt(in_ch)
    state["fc.weight"] = rng.uniform(-bound, bound, (classes, in_ch)).astype(np.float32)
    state["fc.bias"] = rng.uniform(-bound, bound, classes).astype(np.float32)
    return state


def build(state: dict[str, np.ndarray], image_size: int = 224) -> onnx.ModelProto:
    from service.models.graph import GraphBuilder, bn_params

    g = GraphBuilder()
    x = g.normalise_uint8_nhwc(INPUT_NAME, MEAN, STD)
    x = g.op("Relu", [g.conv_bn(x, state["conv1.weight"], bn_params(state, "bn1"), stride=2, eps=BN_EPS)])
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    for li, blocks in enumerate(LAYERS, start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            stride = 2 if b == 0 and li > 1 else 1  # ResNet v1.5: the stride sits on the 3x3 conv
            shortcut = x
            if f"{p}.downsample.0.weight" in state:
                shortcut = g.conv_bn(
                    x,
                    state[f"{p}.downsample.0.weight"],
                    bn_params(state, f"{p}.downsample.1"),
                    stride=stride,
                    eps=BN_EPS,
                )
            y = g.op("Relu", [g.conv_bn(x, state[f"{p}.conv1.weight"], bn_params(state, f"{p}.bn1"), eps=BN_EPS)])
            y = g.op(
                "Relu",
                [g.conv_bn(y, state[f"{p}.conv2.weight"], bn_params(state, f"{p}.bn2"), stride=stride, eps=BN_EPS)],
            )
            y = g.conv_bn(y, state[f"{p}.conv3.weight"], bn_params(state, f"{p}.bn3"), eps=BN_EPS)
            x = g.op("Relu", [g.op("Add", [y, shortcut])])
    out = g.classifier(x, state["fc.weight"], state["fc.bias"])
    return g.finish(out, name="resnet50", image_size=image_size, classes=state["fc.weight"].shape[0])
