"""A declared model completed and checked against what its file says (``service.models.facts``'s
``ModelFacts``, or Triton's metadata made into them: ``service.backends.triton_declared``).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast, get_args

from service.models.declaration import MAX_LABELS, MAX_SIDE, Arithmetic, Declaration, InputDtype, Layout, ModelSource
from service.models.facts import ModelFacts, ModelFileError, TensorFacts, content_facts, flattens, read_content
from service.models.profiles import CLASSIFYING, ModelProfile, OutputKind

CHANNEL_AXIS: dict[Layout, int] = {"NCHW": 1, "NHWC": 3}
MAX_CHANNELS = 4
"""Past this, a fixed axis of an image input is a side, not channels (grey, RGB, RGBA)."""
FLOAT_OUTPUTS = frozenset({"float32", "float16", "float64"})
"""Output element types the derived graph casts to float32."""
MAX_BATCH_BYTES = 2 * 2**30
"""Largest batch the model's input may take, as float32 (``max_batch_size x H x W x 3 x 4``): its
activations are many times that (an image of 4096 x 4096 took 470 MB of them in ONNX Runtime)."""
MAX_EMBEDDING = 65_536
"""Longest embedding a model may give (numbers per image); a classifier's width is bounded by ``MAX_LABELS``."""
FLOAT16_MAX = 65504.0
"""Largest finite float16: past it a float16 model's input is inf, its answers NaN."""


@dataclass(frozen=True)
class ImageModel:
    """What the checks make of a model's facts, before its labels: the image input, its layout,
    size and arithmetic, and the output read with its width (None: dynamic)."""

    image: TensorFacts
    layout: Layout
    input_size: tuple[int, int]
    arithmetic: Arithmetic
    result: TensorFacts
    width: int | None


def examine(d: Declaration, facts: ModelFacts, max_batch_size: int) -> ImageModel:
    """``facts`` checked against the declaration (one image input, its channels, size, layout and
    dtype, the batch axis, the output's shape); ``DeclarationError`` names the key and both values."""
    if not facts.outputs:
        raise d.error("path", "the model has no output")
    image = _image_input(d, facts)
    layout = _layout(d, image)
    input_size = _input_size(d, image, layout)
    arithmetic = _arithmetic(d, image, layout)
    _batch(d, image, max_batch_size)
    _batch_bytes(d, input_size, max_batch_size)
    result = facts.outputs[0]
    return ImageModel(image, layout, input_size, arithmetic, result, _output_width(d, result))


Builder = Callable[[ModelSource, tuple[int, int], OutputKind], Callable[[Path | None], Any]]
"""What builds a declared model's derived graph, from its source, input size and output kind."""


def complete(declaration: Declaration, *, name: str, version: str, max_batch_size: int) -> ModelProfile:
    """The profile of a declared model: what the declaration leaves out filled in from its file,
    and what both say checked to agree. ``DeclarationError`` names the key and both values."""
    from service.models import wrap

    d = declaration
    if d.path is None:
        raise d.error("path", 'a declared model needs its file (path = "model.onnx")')
    try:
        content = read_content(d.path)
        facts = content_facts(content)
    except ModelFileError as exc:
        raise d.error("path", f"{d.path.name} {exc}") from None
    who = f"model {name!r} version {version!r}: "

    def build(source: ModelSource, input_size: tuple[int, int], output: OutputKind) -> Callable[[Path | None], Any]:
        return functools.partial(wrap.build, source, input_size, output, who=who)

    return complete_facts(
        d,
        facts,
        name=name,
        version=version,
        max_batch_size=max_batch_size,
        builder=build,
        revision=wrap.BUILDER_REVISION,
        sha256=content.digest,
    )


def complete_facts(
    d: Declaration,
    facts: ModelFacts,
    *,
    name: str,
    version: str,
    max_batch_size: int,
    builder: Builder,
    revision: int,
    labels_elsewhere: str = "",
    sha256: str = "",
) -> ModelProfile:
    """The profile of a declared model whose facts were read (from its file, or from Triton):
    ``examine``'s checks, then its labels against its output. ``labels_elsewhere``: where else a
    classifier's labels could come from, for the error that asks for them; ``sha256``: the file's
    content as its facts were read (``ModelContent.digest``)."""
    found = examine(d, facts, max_batch_size)
    result, width = found.result, found.width
    output = d.output or "softmax"
    dimensions = None
    if output in CLASSIFYING:
        if d.labels is None:
            shown = f"the model gives {width}" if width is not None else "one per output"
            raise d.error("labels", f'output = "{output}" answers labels: give them ({shown}){labels_elsewhere}')
        if width is not None and len(d.labels) != width:
            raise d.error("labels", f"{len(d.labels)} labels for {width} outputs (the model's output {result})")
    elif width is None:
        raise d.error("output", f"the model's output {result} has a dynamic width; an embedding's must be fixed")
    else:
        dimensions = width
    file = d.path if facts.format != "triton" else None
    source = ModelSource(file, facts.format, found.arithmetic, found.image.name, result.name, sha256)
    return ModelProfile(
        name=name,
        version=version,
        input_size=found.input_size,
        crop_fraction=d.crop_fraction if d.crop_fraction is not None else 0.875,
        builder_revision=revision,
        build=builder(source, found.input_size, output),
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
    arithmetic = Arithmetic(
        color,
        layout,
        dtype,
        d.scale if d.scale is not None else 1 / 255,
        d.mean if d.mean is not None else (0.0, 0.0, 0.0),
        d.std if d.std is not None else (1.0, 1.0, 1.0),
    )
    _arithmetic_range(d, arithmetic)
    return arithmetic


def _arithmetic_range(d: Declaration, a: Arithmetic) -> None:
    """``(x * scale - mean) / std`` for the pixels' extremes (0 and 255), per channel, as the derived
    graph computes it (float32: ``x * (scale / std) + (-mean / std)``), must be finite, and within
    float16's range for a float16 input: else every answer is inf or NaN."""
    import numpy as np

    std = np.asarray(a.std, np.float64)
    with np.errstate(all="ignore"):
        factor = (a.scale / std).astype(np.float32)
        offset = (-np.asarray(a.mean, np.float64) / std).astype(np.float32)
        ends = np.array([[0.0], [255.0]], np.float32) * factor + offset
    bound = FLOAT16_MAX if a.dtype == "float16" else float(np.finfo(np.float32).max)
    if np.all(np.isfinite(ends)) and np.all(np.isfinite(factor)) and float(np.abs(ends).max()) <= bound:
        return
    key = next((k for k in ("std", "scale", "mean") if getattr(d, k) is not None), "std")
    shown = f"scale {a.scale:g}, mean {list(a.mean)}, std {list(a.std)}"
    low, high = float(np.min(ends)), float(np.max(ends))
    limit = f"float16's range (+-{FLOAT16_MAX:g})" if a.dtype == "float16" else "float32's range"
    raise d.error(
        key,
        f"{shown} take the pixels 0 to 255 to {low:g} to {high:g}, outside {limit}: the model's "
        "input would be inf or NaN (check the values: a std is usually about 0.2 to 128, a scale 1/255 or 1)",
    )


def _batch_bytes(d: Declaration, input_size: tuple[int, int], max_batch_size: int) -> None:
    """A batch of ``max_batch_size`` images as float32 must fit ``MAX_BATCH_BYTES`` (the model's
    activations are many times that)."""
    height, width = input_size
    size = max_batch_size * height * width * 3 * 4
    if size <= MAX_BATCH_BYTES:
        return
    fits = MAX_BATCH_BYTES // (height * width * 3 * 4)
    lower = f"max_batch_size to at most {fits}, or input_size" if fits >= 1 else "input_size"
    raise d.error(
        "input_size",
        f"{height} x {width} with max_batch_size {max_batch_size}: a batch is {size / 2**30:.1f} GiB as float32 "
        f"(max_batch_size x {height} x {width} x 3 x 4 bytes), over {MAX_BATCH_BYTES / 2**30:g} GiB: lower {lower}",
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


def _output_width(d: Declaration, output: TensorFacts) -> int | None:
    """Numbers per row of the model's output (None: dynamic), which must be ``[N, D]`` or ``[N, D, 1, 1]``."""
    if output.shape is None or not (len(output.shape) == 2 or flattens(output)):
        raise d.error("output", f"the model's output {output} is not rows of scores: [N, D] (or [N, D, 1, 1])")
    if output.dtype not in FLOAT_OUTPUTS:
        raise d.error("output", f"the model's output {output} is {output.dtype}; the gateway reads floating point")
    width = output.shape[1]
    kind = d.output or "softmax"
    most = MAX_LABELS if kind in CLASSIFYING else MAX_EMBEDDING
    if width is not None and width > most:
        what = "scores (one per label)" if kind in CLASSIFYING else "numbers in an embedding"
        raise d.error("output", f"the model's output {output} gives {width} numbers per image; at most {most} {what}")
    return width
