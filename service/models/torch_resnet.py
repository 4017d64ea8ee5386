"""ResNet-50 as a PyTorch module, for the ``torch`` backend (the model on a GPU inside the gateway).

The same architecture and parameter names as torchvision's ``resnet50`` and as ``resnet.build``'s
ONNX graph, so one ``state_dict`` (torchvision's checkpoint, or ``resnet.random_state_dict``) gives
the same classifier on every backend. Written out here rather than taken from torchvision, which
has no CPU build on PyPI for the tests to use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from service.models import resnet
from service.models.torch_reader import read_state_dict


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, width: int, stride: int, downsample: bool) -> None:
        super().__init__()
        out_ch = width * resnet.EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width, eps=resnet.BN_EPS)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)  # ResNet v1.5
        self.bn2 = nn.BatchNorm2d(width, eps=resnet.BN_EPS)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch, eps=resnet.BN_EPS)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch, eps=resnet.BN_EPS)
            )
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        out: torch.Tensor = self.relu(y + shortcut)
        return out


class ResNet50(nn.Module):
    """Normalised NCHW float input to class probabilities (softmax, as the ONNX graph ends)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64, eps=resnet.BN_EPS)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        for li, (blocks, width) in enumerate(zip(resnet.LAYERS, resnet.WIDTHS, strict=True), start=1):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(in_ch, width, 2 if b == 0 and li > 1 else 1, downsample=b == 0))
                in_ch = width * resnet.EXPANSION
            setattr(self, f"layer{li}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for li in range(1, len(resnet.LAYERS) + 1):
            x = getattr(self, f"layer{li}")(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        return torch.softmax(logits.float(), dim=1)


def load(weights: Path | None) -> tuple[ResNet50, bool]:
    """The model with torchvision's weights from ``weights``, or the random weights the ONNX
    builder uses (seed 0) when none is given; and whether the weights are random."""
    state = read_state_dict(weights) if weights is not None else resnet.random_state_dict(seed=0)
    model = ResNet50(classes=state["fc.weight"].shape[0])
    tensors = {name: torch.from_numpy(np.array(value, np.float32)) for name, value in state.items()}
    model.load_state_dict(tensors, strict=False)  # checkpoints may carry num_batches_tracked; ours do not
    expected = {name for name in model.state_dict() if not name.endswith("num_batches_tracked")}
    missing = expected - set(tensors)
    if missing:
        raise ValueError(f"weights file lacks {len(missing)} ResNet-50 parameters, e.g. {sorted(missing)[0]}")
    return model.eval(), weights is None


def fold_batchnorms(model: ResNet50) -> None:
    """Fold each BatchNorm into the convolution before it (inference only): one kernel instead of two."""

    def fold(owner: nn.Module, conv: str, bn: str) -> None:
        setattr(owner, conv, fuse_conv_bn_eval(getattr(owner, conv), getattr(owner, bn)))
        setattr(owner, bn, nn.Identity())

    fold(model, "conv1", "bn1")
    for block in model.modules():
        if isinstance(block, Bottleneck):
            for i in (1, 2, 3):
                fold(block, f"conv{i}", f"bn{i}")
            if block.downsample is not None:
                fold(block.downsample, "0", "1")
