"""A declared model's file, read: what its input and output are (``ModelFacts``), and the
declaration completed and checked against them (``complete``).

The file says what it can (input name, element type, shape, the output's width); the declaration
says what no file says (the arithmetic its training used, the labels, what the output means) and
may repeat what the file says, which must then agree. Every disagreement is a ``DeclarationError``
naming the model, the version, the key and both values, at start, before anything is served.

ONNX files are read without their weights' external data (a model over 2 GB, refused here);
OpenVINO IR with its ``.bin`` beside it. Torch ``.pt2`` files are refused: serving one would need a
conversion to ONNX that ``torch.onnx.export`` does better where the model was written.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast, get_args

from service.models.declaration import MAX_SIDE, Arithmetic, Declaration, Format, InputDtype, Layout, ModelSource
from service.models.profiles import CLASSIFYING, ModelProfile

if TYPE_CHECKING:
    import onnx

Shape = tuple[int | None, ...]
"""A tensor's dimensions, None where a dimension is dynamic (named, or not given)."""

MAX_ONNX_BYTES = 2**31 - 1
"""Protobuf's limit: an ONNX file past it keeps its weights in external data files."""
MIN_OPSET = 7
"""The first ONNX operator set whose arithmetic broadcasts as NumPy does (2017)."""
CHANNEL_AXIS: dict[Layout, int] = {"NCHW": 1, "NHWC": 3}
MAX_CHANNELS = 4
"""Past this, a fixed axis of an image input is a side, not channels (grey, RGB, RGBA)."""
FLOAT_OUTPUTS = frozenset({"float32", "float16", "float64"})
"""Output element types the derived graph casts to float32."""

_ONNX_TYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
               11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}  # fmt: skip
_OPENVINO_TYPES = {"f32": "float32", "f16": "float16", "u8": "uint8", "f64": "float64", "bf16": "bfloat16",
                   "i8": "int8", "i32": "int32", "i64": "int64", "boolean": "bool"}  # fmt: skip


class ModelFileError(ValueError):
    """The file is not a model the gateway can read (the message says why, without the file's name)."""


@dataclass(frozen=True)
class TensorFacts:
    """One input or output, as the model file declares it."""

    name: str
    dtype: str
    """NumPy's name for its element type (``float32``, ``uint8``...), or what the file says."""
    shape: Shape | None
    """None: the file does not say its rank."""

    def __str__(self) -> str:
        dims = "?" if self.shape is None else ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name!r} [{dims}] {self.dtype}"


@dataclass(frozen=True)
class ModelFacts:
    """What a model file says about its inputs and outputs."""

    format: Format
    inputs: tuple[TensorFacts, ...]
    """Inputs it must be fed (an ONNX graph's inputs that have no initializer)."""
    outputs: tuple[TensorFacts, ...]


def read_facts(path: Path) -> ModelFacts:
    """The facts of the model file at ``path`` (its kind by its suffix); ``ModelFileError`` if unreadable."""
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return onnx_facts(load_onnx(read_model_bytes(path)))
    if suffix == ".xml":
        return openvino_facts(path)
    if suffix == ".pt2":
        raise ModelFileError("is a torch .pt2 file: not served yet; export the model to ONNX with torch.onnx.export")
    raise ModelFileError("is not a model file: .onnx, an OpenVINO IR .xml or a torch .pt2")


def read_model_bytes(path: Path, limit: int = MAX_ONNX_BYTES) -> bytes:
    """A model file's bytes: a regular file of at most ``limit`` bytes (a FIFO is refused, not waited on;
    past ``MAX_ONNX_BYTES``, protobuf's limit, an ONNX file keeps its weights in external data)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelFileError(f"cannot be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError("is not a regular file")
        if info.st_size > limit:
            hint = "an ONNX model that large keeps its weights in external data files, not served yet"
            raise ModelFileError(
                f"is {info.st_size / 2**30:.1f} GiB, over {limit / 2**30:.0f} GiB"
                + (f" ({hint})" if limit == MAX_ONNX_BYTES else "")
            )
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise ModelFileError(f"grew past {limit / 2**30:.0f} GiB while it was read")
    return b"".join(chunks)


def load_onnx(data: bytes) -> onnx.ModelProto:
    """An ONNX model from its bytes, checked: a truncated file or another kind of file is a
    ``ModelFileError`` (protobuf parses an empty file, and some others, to an empty model)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError):
        raise ModelFileError("is not an ONNX model (it does not parse: truncated, or another kind of file)") from None
    if model.ir_version <= 0 or not model.graph.node or not model.graph.output:
        raise ModelFileError("is not an ONNX model (no graph: empty, truncated, or another kind of file)")
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensors(model.graph)):
        raise ModelFileError("keeps weights in external data files (an ONNX model over 2 GiB): not served yet")
    opset = default_opset(model)
    if opset is None or opset < MIN_OPSET:
        raise ModelFileError(
            f"uses ONNX operator set {opset}; the gateway needs {MIN_OPSET} or later: "
            "convert it with onnx.version_converter.convert_version"
        )
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"is not a valid ONNX model: {first[:300]}") from None
    return model


def default_opset(model: onnx.ModelProto) -> int | None:
    """The version of the ONNX operator set (the default domain) the model imports, or None."""
    versions = [int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return max(versions) if versions else None


def onnx_facts(model: onnx.ModelProto) -> ModelFacts:
    graph = model.graph
    initialized = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    inputs = tuple(_onnx_tensor(v) for v in graph.input if v.name not in initialized)
    return ModelFacts("onnx", inputs, tuple(_onnx_tensor(v) for v in graph.output))


def _onnx_tensor(value: onnx.ValueInfoProto) -> TensorFacts:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        return TensorFacts(value.name, f"not a tensor ({kind})", None)
    tensor = value.type.tensor_type
    dtype = _ONNX_TYPES.get(tensor.elem_type, f"ONNX type {tensor.elem_type}")
    if not tensor.HasField("shape"):
        return TensorFacts(value.name, dtype, None)
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor.shape.dim)
    return TensorFacts(value.name, dtype, dims)


def _tensors(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """Every tensor a graph holds, its subgraphs' and its Constant nodes' included."""
    from onnx import AttributeProto

    found = list(graph.initializer) + [t.values for t in graph.sparse_initializer]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.TENSOR:
                found.append(attr.t)
            found.extend(attr.tensors)
            for sub in ([attr.g] if attr.type == AttributeProto.GRAPH else []) + list(attr.graphs):
                found.extend(_tensors(sub))
    return found


def ir_weights(path: Path) -> Path:
    """An OpenVINO IR's weights file: its ``.bin`` beside it (OpenVINO loads an IR without one as
    a model without weights, which fails later, or not at all)."""
    weights = path.with_suffix(".bin")
    if not weights.is_file():
        raise ModelFileError(f"needs its weights beside it (an OpenVINO IR's .bin): {weights.name} is not there")
    return weights


def openvino_facts(path: Path) -> ModelFacts:
    import openvino as ov

    ir_weights(path)
    try:
        model = ov.Core().read_model(path)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
        raise ModelFileError(f"is not an OpenVINO IR: {first[:300]}") from None
    return ModelFacts("openvino", tuple(map(openvino_tensor, model.inputs)), tuple(map(openvino_tensor, model.outputs)))


def openvino_tensor(port: object) -> TensorFacts:
    names = sorted(port.get_names())  # type: ignore[attr-defined]
    name = names[0] if names else port.get_node().get_friendly_name()  # type: ignore[attr-defined]
    kind = port.get_element_type().get_type_name()  # type: ignore[attr-defined]
    shape = port.get_partial_shape()  # type: ignore[attr-defined]
    dims = None
    if shape.rank.is_static:
        dims = tuple(d.get_length() if d.is_static else None for d in shape)
    return TensorFacts(name, _OPENVINO_TYPES.get(kind, kind), dims)


def complete(declaration: Declaration, *, name: str, version: str, max_batch_size: int) -> ModelProfile:
    """The profile of a declared model: what the declaration leaves out filled in from its file,
    and what both say checked to agree. ``DeclarationError`` names the key and both values."""
    from service.models import wrap

    d = declaration
    if d.path is None:
        raise d.error("path", 'a declared model needs its file (path = "model.onnx")')
    try:
        facts = read_facts(d.path)
    except ModelFileError as exc:
        raise d.error("path", f"{d.path.name} {exc}") from None
    image = _image_input(d, facts)
    layout = _layout(d, image)
    input_size = _input_size(d, image, layout)
    arithmetic = _arithmetic(d, image, layout)
    _batch(d, image, max_batch_size)
    if not facts.outputs:
        raise d.error("path", f"{d.path.name} has no output")
    result = facts.outputs[0]
    width = _output_width(d, result)
    output = d.output or "softmax"
    dimensions = None
    if output in CLASSIFYING:
        if d.labels is None:
            shown = f"the model gives {width}" if width is not None else "one per output"
            raise d.error("labels", f'output = "{output}" answers labels: give them ({shown})')
        if width is not None and len(d.labels) != width:
            raise d.error("labels", f"{len(d.labels)} labels for {width} outputs (the model's output {result})")
    elif width is None:
        raise d.error("output", f"the model's output {result} has a dynamic width; an embedding's must be fixed")
    else:
        dimensions = width
    source = ModelSource(d.path, facts.format, arithmetic, image.name, result.name)
    return ModelProfile(
        name=name,
        version=version,
        input_size=input_size,
        crop_fraction=d.crop_fraction if d.crop_fraction is not None else 0.875,
        builder_revision=wrap.BUILDER_REVISION,
        build=functools.partial(wrap.build, source, input_size, output),
        resize=d.resize or "crop",
        output=output,
        threshold=d.threshold if d.threshold is not None else 0.5,
        label_names=d.labels,
        dimensions=dimensions,
        source=source,
    )


def _image_input(d: Declaration, facts: ModelFacts) -> TensorFacts:
    """The model's one input, an image: rank 4, of an element type the gateway can feed."""
    if len(facts.inputs) != 1:
        shown = "; ".join(map(str, facts.inputs[:4])) + ("; ..." if len(facts.inputs) > 4 else "") or "none"
        raise d.error(
            "path",
            f"the model takes {len(facts.inputs)} inputs ({shown}); the gateway feeds one, the image",
        )
    image = facts.inputs[0]
    if image.shape is None or len(image.shape) != 4:
        rank = "an unknown rank" if image.shape is None else f"rank {len(image.shape)}"
        raise d.error("path", f"the model's input {image} has {rank}; an image input is [N, C, H, W] or [N, H, W, C]")
    allowed = get_args(InputDtype)
    if image.dtype not in allowed:
        raise d.error(
            "input_dtype", f"the model's input {image} takes {image.dtype}; the gateway feeds {', '.join(allowed)}"
        )
    if d.input_dtype is not None and d.input_dtype != image.dtype:
        raise d.error("input_dtype", f'"{d.input_dtype}" declared; the model\'s input {image} takes {image.dtype}')
    return image


def _layout(d: Declaration, image: TensorFacts) -> Layout:
    """Where the model takes its 3 channels: the declared layout, checked, or the one axis of 3."""
    assert image.shape is not None
    shape = image.shape
    if d.layout is not None:
        channels = shape[CHANNEL_AXIS[d.layout]]
        if channels == 3:
            return d.layout
        other: Layout = "NHWC" if d.layout == "NCHW" else "NCHW"
        if shape[CHANNEL_AXIS[other]] == 3:
            axis = CHANNEL_AXIS[d.layout]
            raise d.error(
                "layout", f'"{d.layout}" declared (channels on axis {axis}); the model\'s input {image} is {other}'
            )
        _channels_problem(d, image, channels)
    found: list[Layout] = [layout for layout, axis in CHANNEL_AXIS.items() if shape[axis] == 3]
    if len(found) == 1:
        return found[0]
    if len(found) == 2:
        raise d.error("layout", f"the model's input {image} may be NCHW or NHWC: declare which")
    first, last = shape[1], shape[3]
    if first is not None and last is not None:
        _channels_problem(d, image, min(first, last))
    fixed = first if first is not None else last  # a small one is the channels ([N, 1, H, W]), a large one a side
    _channels_problem(d, image, fixed if fixed is not None and fixed <= MAX_CHANNELS else None)


def _channels_problem(d: Declaration, image: TensorFacts, channels: int | None) -> NoReturn:
    if channels is None:
        raise d.error(
            "layout",
            f"the model's input {image} has a dynamic channel count; it must be fixed at 3 (re-export it with "
            "a fixed channel axis)",
        )
    color = d.color or "RGB"
    plural = "" if channels == 1 else "s"
    raise d.error("color", f"the model's input {image} takes {channels} channel{plural}; {color} images have 3")


def _input_size(d: Declaration, image: TensorFacts, layout: Layout) -> tuple[int, int]:
    assert image.shape is not None
    axes = (2, 3) if layout == "NCHW" else (1, 2)
    height, width = (image.shape[a] for a in axes)
    if d.input_size is not None:
        for side, model_side, what in zip(d.input_size, (height, width), ("height", "width"), strict=True):
            if model_side is not None and model_side != side:
                declared = f"[{d.input_size[0]}, {d.input_size[1]}]"
                raise d.error("input_size", f"{declared} declared; the model's input {image} takes {what} {model_side}")
        return d.input_size
    if height is None or width is None:
        raise d.error("input_size", f"the model's input {image} has a dynamic height or width: declare input_size")
    if height > MAX_SIDE or width > MAX_SIDE:
        raise d.error("input_size", f"the model's input {image} is over {MAX_SIDE} pixels a side")
    return height, width


def _arithmetic(d: Declaration, image: TensorFacts, layout: Layout) -> Arithmetic:
    """The declared arithmetic, with the defaults: a float input takes ``x / 255``; a uint8 input
    the pixels as they are (the declaration cannot say otherwise)."""
    color = d.color or "RGB"
    dtype = cast(InputDtype, image.dtype)  # _image_input checked it
    if dtype == "uint8":
        given = [key for key in ("scale", "mean", "std") if getattr(d, key) is not None]
        if given:
            raise d.error(
                given[0], f"the model's input {image} takes uint8, the pixels as they are: no scale, mean or std"
            )
        return Arithmetic(color, layout, dtype, 1.0)
    return Arithmetic(
        color,
        layout,
        dtype,
        d.scale if d.scale is not None else 1 / 255,
        d.mean if d.mean is not None else (0.0, 0.0, 0.0),
        d.std if d.std is not None else (1.0, 1.0, 1.0),
    )


def _batch(d: Declaration, image: TensorFacts, max_batch_size: int) -> None:
    """A fixed batch axis takes that many images exactly; the gateway sends 1 to max_batch_size."""
    assert image.shape is not None
    batch = image.shape[0]
    if batch is None:
        return
    if batch != 1:
        raise d.error(
            "path",
            f"the model's input {image} takes batches of exactly {batch}; the gateway sends 1 to max_batch_size "
            "images: export it with a dynamic batch axis",
        )
    if max_batch_size != 1:
        raise d.error(
            "max_batch_size",
            f"the model's input {image} takes one image at a time; max_batch_size is {max_batch_size}: set "
            "max_batch_size = 1, or export the model with a dynamic batch axis",
        )


def flattens(output: TensorFacts) -> bool:
    """Whether an output is ``[N, D, 1, 1]`` (a convolutional head), flattened to ``[N, D]``."""
    return output.shape is not None and len(output.shape) == 4 and output.shape[2:] == (1, 1)


def _output_width(d: Declaration, output: TensorFacts) -> int | None:
    """Numbers per row of the model's output (None: dynamic), which must be ``[N, D]`` or ``[N, D, 1, 1]``."""
    if output.shape is None or not (len(output.shape) == 2 or flattens(output)):
        raise d.error("output", f"the model's output {output} is not rows of scores: [N, D] (or [N, D, 1, 1])")
    if output.dtype not in FLOAT_OUTPUTS:
        raise d.error("output", f"the model's output {output} is {output.dtype}; the gateway reads floating point")
    return output.shape[1]
