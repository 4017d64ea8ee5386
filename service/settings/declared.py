"""The settings of one declared model (``gateway serve --model-path cars.onnx --labels cars.txt``):
the keys of a models file's ``[models.NAME]`` table, as flags and ``GATEWAY_*`` variables, for a
gateway that serves one model of its own. They are checked where a models file's are
(``service.models.declaration``); here they are only typed. See docs/models.md."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from service.settings.values import setting_name

DECLARING = (
    "labels",
    "input_size",
    "resize",
    "crop_fraction",
    "color",
    "layout",
    "input_dtype",
    "scale",
    "mean",
    "std",
    "output",
    "threshold",
)
"""The settings that declare the ``model_path`` model (a models file's keys of the same names)."""


class DeclaredModelFields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    model_path: Path | None = None
    """A model file of your own to serve (.onnx; an OpenVINO IR .xml with ``backend=openvino``),
    under the name ``model`` if set, else the file's name; with ``labels`` and, where the file does
    not say them, the keys below. A models file declares several (``models_file``)."""
    labels: Path | None = None
    """The ``model_path`` model's labels: one per line, or a JSON list (``.json``)."""
    input_size: str | None = None
    """Height and width the images are resized to, ``260`` or ``260,200`` (default: the model's)."""
    resize: Literal["crop", "stretch", "letterbox"] | None = None
    """How a photo becomes the input: ``crop`` (default; centre crop of ``crop_fraction``),
    ``stretch`` (aspect ratio ignored) or ``letterbox`` (fitted inside, padded with grey)."""
    crop_fraction: float | None = None
    """With ``resize=crop``: the share of the image kept around the centre (default 0.875)."""
    color: Literal["RGB", "BGR"] | None = None
    """Channel order the model takes (default RGB)."""
    layout: Literal["NCHW", "NHWC"] | None = None
    """Layout the model takes (default: the model's, from its input's shape)."""
    input_dtype: Literal["uint8", "float32", "float16"] | None = None
    """Element type the model takes (default: the model's)."""
    scale: float | None = None
    """Pixel values times ``scale``, then ``(x - mean) / std`` (default 1/255 for float inputs)."""
    mean: str | None = None
    """Per channel, in the model's colour order: ``0.485,0.456,0.406`` or one number (default 0)."""
    std: str | None = None
    """Per channel, in the model's colour order: ``0.229,0.224,0.225`` or one number (default 1)."""
    output: Literal["softmax", "logits", "sigmoid", "embedding"] | None = None
    """What the output is: ``softmax`` (default), ``logits``, ``sigmoid`` (multi-label) or ``embedding``."""
    threshold: float | None = None
    """With ``output=sigmoid``: the score at or above which a label is answered (default 0.5)."""
    models_root: Path | None = None
    """Where declared models' files and labels must be (symlinks followed); a path outside is refused
    at start. Unset: any file the gateway can read."""

    @model_validator(mode="after")
    def _only_with_a_model_path(self) -> DeclaredModelFields:
        """A declaring setting without ``model_path`` would be ignored without a word."""
        stray = [key for key in DECLARING if getattr(self, key) is not None]
        if stray and self.model_path is None:
            raise ValueError(
                f"{setting_name(stray[0])} declares the model of {setting_name('model_path')}, which is not set "
                "(in a models file, give it as the model's key)"
            )
        return self

    def declared(self) -> dict[str, object]:
        """The model table these settings declare (empty without ``model_path``): a models file's keys."""
        if self.model_path is None:
            return {}
        table: dict[str, object] = {"path": str(self.model_path)}
        for key in (
            "labels",
            "resize",
            "crop_fraction",
            "color",
            "layout",
            "input_dtype",
            "scale",
            "output",
            "threshold",
        ):
            value = getattr(self, key)
            if value is not None:
                table[key] = str(value) if isinstance(value, Path) else value
        for key in ("input_size", "mean", "std"):
            text = getattr(self, key)
            if text is not None:
                table[key] = [_number(part) for part in text.split(",")]
        return table


def _number(text: str) -> object:
    """A number of a comma-separated setting, as TOML would give it (a bad one stays text, and the
    declaration's check names it)."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
