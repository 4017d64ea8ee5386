"""A model a user declares in a models file (or with ``--model-path`` and its flags): its file, its
labels, the input geometry and arithmetic it was trained with, and what its output means.

Each key is checked here on its own (type, range, no inf or nan, files bounded and confined to
``models_root``); ``service.models.reading`` then reads the model file itself and checks the
declaration against what it says (input name, shape, dtype, layout; output width). An error names
the model, the version and the key: ``DeclarationError``'s message is the whole sentence.

Keys (all optional but ``path`` or a Triton backend; what the model file says fills the rest; a model
already in the user's Triton has no ``path``: what Triton says fills the rest,
``service.backends.triton_declared``)::

    path = "models/cars.onnx"    # .onnx, OpenVINO IR .xml (its .bin beside it), torch .pt2
    labels = "models/cars.txt"   # one label per line, a JSON list (.json), or a TOML list of strings
    input_size = [260, 260]      # height, width (one number: square); default: the model's
    resize = "crop"              # "crop", "stretch", "letterbox"
    crop_fraction = 0.875        # resize = "crop" only
    color = "RGB"                # channel order the model takes: "RGB" or "BGR"
    layout = "NCHW"              # "NCHW" or "NHWC"; default: the model's (its channel axis)
    input_dtype = "float32"      # "uint8", "float32", "float16"; default: the model's
    scale = 0.00392156862        # x' = (x * scale - mean) / std, per channel, in the model's colour order
    mean = [0.485, 0.456, 0.406]
    std = [0.229, 0.224, 0.225]
    output = "softmax"           # "softmax", "logits", "sigmoid", "embedding"
    threshold = 0.5              # output = "sigmoid" only
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from service.images.geometry import Resize
from service.models.profiles import OutputKind
from service.settings.declared import DECLARING
from service.settings.values import read_regular_file

DECLARED_KEYS = ("path", *DECLARING)
"""The keys that declare a model (a model's table or a version's; a version's own win): the file and
what the ``--model-path`` settings of the same names declare."""

Color = Literal["RGB", "BGR"]
Layout = Literal["NCHW", "NHWC"]
InputDtype = Literal["uint8", "float32", "float16"]
Format = Literal["onnx", "openvino", "torch", "triton"]
"""A model's kind: a file's (by its suffix), or ``triton``: a model in the user's Triton, no file here."""

FORMATS: dict[str, Format] = {".onnx": "onnx", ".xml": "openvino", ".pt2": "torch"}
"""A model file's kind, by its suffix."""
MAX_SIDE = 4096
"""Largest input side: a batch of 64 such float32 images is already 12 GB."""
MAX_LABELS = 100_000
MAX_LABEL_CHARS = 512
MAX_LABELS_BYTES = 4 * 1024 * 1024
"""Bounds of a labels file: ImageNet-21k's 21,843 labels with their synonyms take under 1 MB."""
MAX_PATH_CHARS = 4096
MAX_ARITHMETIC = 1e6
"""Bound of ``scale``, ``mean`` and ``std``'s magnitude: past it a value is a typo, not a model's."""


class DeclarationError(ValueError):
    """A declared key is wrong; the message names the model, the version, the key and the values."""


@dataclass(frozen=True)
class Arithmetic:
    """What a model's input takes, from the uint8 RGB NHWC images the gateway decodes:
    ``(x * scale - mean) / std`` per channel, in ``color`` order, ``layout`` and ``dtype``
    (a ``uint8`` input takes the pixels as they are: scale 1, mean 0, std 1)."""

    color: Color = "RGB"
    layout: Layout = "NCHW"
    dtype: InputDtype = "float32"
    scale: float = 1 / 255
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    @property
    def identity(self) -> bool:
        """Nothing but a cast (and any swap and transpose): the pixels' values as they are."""
        return self.scale == 1 and self.mean == (0.0, 0.0, 0.0) and self.std == (1.0, 1.0, 1.0)


@dataclass(frozen=True)
class ModelSource:
    """A user's model and what its input takes: a file (the built graph puts that arithmetic in
    front), or a model in the user's Triton (``format`` ``triton``, no file: the triton backend
    does the arithmetic in NumPy)."""

    file: Path | None
    """The model file; None for a model in Triton (``path`` is then an error: nothing reads it)."""
    format: Format
    arithmetic: Arithmetic
    input_name: str
    """The model's image input, as its file (or Triton) names it; "" where Triton is asked at start."""
    output_name: str
    """The model's output the gateway reads (its first); "" where Triton is asked at start."""
    sha256: str = ""
    """The file's content as checked at start (``ModelContent.digest``; "": no file): a file
    replaced since is refused when its model is derived, not served unchecked."""

    @property
    def path(self) -> Path:
        """The model file (only a file's source has one: the in-process backends read it)."""
        if self.file is None:
            raise ValueError(f"a model in Triton ({self.format}) has no file here")
        return self.file


@dataclass(frozen=True)
class Declaration:
    """The declared keys, each checked on its own; None where a key is not given."""

    where: str
    """Who declared it, for errors: ``models.toml: model 'cars' version '1'``."""
    path: Path | None = None
    """Resolved: absolute, symlinks followed."""
    labels: tuple[str, ...] | None = None
    input_size: tuple[int, int] | None = None
    resize: Resize | None = None
    crop_fraction: float | None = None
    color: Color | None = None
    layout: Layout | None = None
    input_dtype: InputDtype | None = None
    scale: float | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    output: OutputKind | None = None
    threshold: float | None = None

    @property
    def format(self) -> Format | None:
        return FORMATS[self.path.suffix.lower()] if self.path is not None else None

    def error(self, key: str, problem: str) -> DeclarationError:
        return DeclarationError(f"{self.where}: {key}: {problem}")


def parse_declaration(entry: Mapping[str, Any], where: str, *, base: Path, root: Path | None) -> Declaration:
    """The declared keys of ``entry`` (the model's table merged with the version's), checked.

    ``base``: the folder relative paths are taken from (the models file's); ``root``: where the
    files must be, symlinks followed (``models_root``; None: anywhere readable)."""
    d = Declaration(where)

    def fail(key: str, problem: str) -> DeclarationError:
        return d.error(key, problem)

    path = _file(entry["path"], "path", base, root, fail) if "path" in entry else None
    if path is not None and path.suffix.lower() not in FORMATS:
        raise fail("path", f"{path.name}: a model file is .onnx, an OpenVINO IR .xml or a torch .pt2")
    if path is not None and path.suffix.lower() == ".xml" and os.path.lexists(path.with_suffix(".bin")):
        _file(str(path.with_suffix(".bin")), "path", base, root, fail)  # its weights: read too, so confined too
    labels = _labels(entry["labels"], base, root, fail) if "labels" in entry else None
    input_size = _size(entry["input_size"], fail) if "input_size" in entry else None
    resize: Resize | None = _choice(entry, "resize", get_args(Resize), fail)
    crop_fraction = None
    if "crop_fraction" in entry:
        crop_fraction = _number(entry["crop_fraction"], "crop_fraction", fail)
        if not 0 < crop_fraction <= 1:
            raise fail("crop_fraction", f"{crop_fraction!r} is not in (0, 1]")
        if resize not in (None, "crop"):
            raise fail("crop_fraction", f'applies to resize = "crop", not resize = "{resize}"')
    color: Color | None = _choice(entry, "color", get_args(Color), fail, upper=True)
    layout: Layout | None = _choice(entry, "layout", get_args(Layout), fail, upper=True)
    dtype: InputDtype | None = _choice(entry, "input_dtype", get_args(InputDtype), fail)
    scale = None
    if "scale" in entry:
        scale = _number(entry["scale"], "scale", fail)
        if not 0 < scale <= MAX_ARITHMETIC:
            raise fail("scale", f"{scale!r} is not above 0 (and at most {MAX_ARITHMETIC:g})")
    mean = _triple(entry["mean"], "mean", fail) if "mean" in entry else None
    std = _triple(entry["std"], "std", fail) if "std" in entry else None
    if std is not None and any(s <= 0 for s in std):
        raise fail("std", f"{list(std)}: every value must be above 0 (the model's input divides by it)")
    if dtype == "uint8":
        given = [key for key in ("scale", "mean", "std") if key in entry]
        if given:
            raise fail(given[0], 'input_dtype = "uint8" takes the pixels as they are: no scale, mean or std')
    output: OutputKind | None = _choice(entry, "output", get_args(OutputKind), fail)
    threshold = None
    if "threshold" in entry:
        threshold = _number(entry["threshold"], "threshold", fail)
        if not 0 <= threshold <= 1:
            raise fail("threshold", f"{threshold!r} is not in [0, 1]")
        if output != "sigmoid":
            raise fail("threshold", 'applies to output = "sigmoid" (every label at or above it)')
    if output == "embedding" and labels is not None:
        raise fail("labels", 'an embedding model (output = "embedding") has no labels')
    return Declaration(where, path, labels, input_size, resize, crop_fraction, color, layout, dtype,
                       scale, mean, std, output, threshold)  # fmt: skip


def _file(value: Any, key: str, base: Path, root: Path | None, fail: Any) -> Path:
    """A file path: relative to ``base``, symlinks followed, inside ``root`` when one is set."""
    if not isinstance(value, str) or not value.strip():
        raise fail(key, "must be a file path (a non-empty string)")
    if "\0" in value or len(value) > MAX_PATH_CHARS:
        raise fail(key, f"is not a usable path (NUL byte, or over {MAX_PATH_CHARS} characters)")
    path = Path(os.path.realpath(base / value))
    if root is not None:
        confined = Path(os.path.realpath(root))
        if not path.is_relative_to(confined):
            raise fail(key, f"{value!r} is outside the models root ({confined}), symlinks followed")
    if not path.is_file():
        raise fail(key, f"{value!r} is not a file ({path})")
    return path


def _labels(value: Any, base: Path, root: Path | None, fail: Any) -> tuple[str, ...]:
    """Labels from a list of strings, or a file of them: one per line, or a JSON list (``.json``)."""
    if isinstance(value, list):
        labels = value
    else:
        path = _file(value, "labels", base, root, fail)
        try:
            text = read_regular_file(path, MAX_LABELS_BYTES, "labels")
        except ValueError as exc:
            raise fail("labels", str(exc).removeprefix("labels: ")) from None
        if path.suffix.lower() == ".json":
            try:
                labels = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise fail("labels", f"{path.name} is not valid JSON: {exc}") from None
            if not isinstance(labels, list):
                raise fail("labels", f"{path.name} must hold a JSON list of strings")
        else:
            labels = text.removesuffix("\n").split("\n")
            labels = [label.removesuffix("\r") for label in labels]
    if not labels or labels == [""]:
        raise fail("labels", "holds no labels")
    if len(labels) > MAX_LABELS:
        raise fail("labels", f"holds {len(labels)} labels; at most {MAX_LABELS}")
    for i, label in enumerate(labels):
        if not isinstance(label, str):
            raise fail("labels", f"label {i + 1} is not a string")
        if len(label) > MAX_LABEL_CHARS:
            raise fail("labels", f"label {i + 1} is {len(label)} characters long; at most {MAX_LABEL_CHARS}")
        if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in label):
            raise fail("labels", f"label {i + 1} holds a control character or a lone surrogate")
    return tuple(labels)


def _size(value: Any, fail: Any) -> tuple[int, int]:
    sides = value if isinstance(value, list) else [value]
    if len(sides) == 1:
        sides = sides * 2
    if len(sides) != 2 or any(type(side) is not int or not 1 <= side <= MAX_SIDE for side in sides):
        raise fail("input_size", f"must be a side or [height, width], whole numbers from 1 to {MAX_SIDE}")
    return sides[0], sides[1]


def _choice(entry: Mapping[str, Any], key: str, allowed: tuple[str, ...], fail: Any, *, upper: bool = False) -> Any:
    if key not in entry:
        return None
    value = entry[key]
    if isinstance(value, str) and upper:
        value = value.upper()
    if value not in allowed:
        shown = repr(value) if isinstance(value, str) and len(value) <= 32 else "this value"
        raise fail(key, f"{shown} is not one of {', '.join(allowed)}")
    return value


def _number(value: Any, key: str, fail: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(key, "must be a finite number")
    if abs(value) > MAX_ARITHMETIC:
        raise fail(key, f"{value!r} is too large (at most {MAX_ARITHMETIC:g})")
    return float(value)


def _triple(value: Any, key: str, fail: Any) -> tuple[float, float, float]:
    """Three numbers, one per channel in the model's colour order (one number: all three)."""
    numbers = value if isinstance(value, list) else [value]
    if len(numbers) == 1:
        numbers = numbers * 3
    if len(numbers) != 3:
        raise fail(key, f"must be one number or three (one per channel), not {len(numbers)}")
    a, b, c = (_number(n, key, fail) for n in numbers)
    return a, b, c
