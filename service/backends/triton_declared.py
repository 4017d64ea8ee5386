"""A model already in the user's Triton, declared in a models file without ``path``
(``backend = "triton"``; ``triton_model`` names it): its declaration completed and checked against
what Triton says, as a file's is against what the file says.

Triton's model metadata gives the input's name, element type and shape and the output's; its
model config the largest batch. They become a ``ModelFacts`` (format ``triton``), and the same
checks as a file's (``service.models.reading``) complete the declaration with the same errors,
naming the model, the version, the key and both values (a key ``path`` there reads
``triton_model`` here). A declaration that says everything the gateway needs (``input_size``,
``layout``, ``input_dtype`` and ``labels``) is completed from itself, without asking Triton at
start (``answers_itself``); the backend's readiness check then completes it again from Triton's
metadata (``check_on_triton``), so a model that does not take what was declared is never served.

The model's input and output are sent and read in its own element type and layout: the backend
does the declared arithmetic in NumPy (``service.backends.arithmetic``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.backends.triton_datatypes import TRITON_TYPES
from service.models import reading
from service.models.declaration import Declaration, DeclarationError, parse_declaration
from service.models.facts import ModelFacts, TensorFacts
from service.models.profiles import CLASSIFYING, ModelProfile
from service.models.reading import ImageModel, examine

if TYPE_CHECKING:
    from service.settings import Settings

BUILDER_REVISION = 1
"""A model in Triton is not built here; the profile's field says nothing of it."""
MAX_TENSORS = 64
"""Inputs or outputs read from Triton's metadata (a model with more is refused all the same)."""
MAX_RANK = 8
DIM_TEXT = re.compile(r"-?[0-9]{1,19}")
MAX_DIM = 2**31 - 1
"""Largest dimension taken from Triton's metadata (its protocol's are int64; a model's sides and widths
are bounded far below by the declaration's checks)."""


class MetadataError(ValueError):
    """Triton's metadata is not what Triton's protocol says it is (the message says what)."""


def triton_facts(metadata: Mapping[str, Any]) -> ModelFacts:
    """What Triton's model metadata (its JSON: gRPC's ``as_json`` or HTTP's) says of the model's
    inputs and outputs; the batch axis is in the shapes (``-1``: dynamic, as ``None``)."""
    if not isinstance(metadata, Mapping):
        raise MetadataError("the model metadata is not a JSON object")
    return ModelFacts("triton", _tensors(metadata, "inputs"), _tensors(metadata, "outputs"))


def _tensors(metadata: Mapping[str, Any], key: str) -> tuple[TensorFacts, ...]:
    listed = metadata.get(key, [])
    if not isinstance(listed, list) or len(listed) > MAX_TENSORS:
        raise MetadataError(f"the model metadata's {key} are not a list of at most {MAX_TENSORS} tensors")
    tensors = []
    for entry in listed:
        name, datatype, shape = (
            entry.get(k) if isinstance(entry, Mapping) else None for k in ("name", "datatype", "shape")
        )
        if not isinstance(name, str) or not isinstance(datatype, str) or not isinstance(shape, list):
            raise MetadataError(f"the model metadata's {key} hold a tensor without a name, datatype and shape")
        dims = tuple(map(_dim, shape))
        if None in dims:
            raise MetadataError(f"tensor {name[:64]!r}'s shape {str(shape)[:64]} is not whole numbers")
        if len(dims) > MAX_RANK or any(d < -1 or d > MAX_DIM for d in dims):
            raise MetadataError(f"tensor {name[:64]!r}'s shape {str(shape)[:64]} is not a shape")
        tensors.append(
            TensorFacts(name, TRITON_TYPES.get(datatype, datatype), tuple(d if d >= 0 else None for d in dims))
        )
    return tuple(tensors)


def _dim(value: object) -> Any:
    """A dimension as Triton's JSON gives it: a whole number (HTTP), or one as a decimal string
    (gRPC's JSON writes int64 so); None for anything else (not ``int()``: 3.9 is not 3, True not 1)."""
    if type(value) is int:
        return value
    if type(value) is str and DIM_TEXT.fullmatch(value):
        return int(value)
    return None


def answers_itself(d: Declaration) -> bool:
    """Whether the declaration says everything the gateway needs to start (the input's size,
    layout and element type, and the labels of a classifier): Triton need not be asked at start.
    An embedding's width is Triton's to say."""
    output = d.output or "softmax"
    complete = d.input_size is not None and d.layout is not None and d.input_dtype is not None
    return complete and output in CLASSIFYING and d.labels is not None


def declared_facts(d: Declaration) -> ModelFacts:
    """The facts the declaration states (``answers_itself``), names unknown until Triton is asked."""
    assert d.input_size is not None
    assert d.input_dtype is not None
    assert d.labels is not None
    height, width = d.input_size
    shape = (None, 3, height, width) if d.layout == "NCHW" else (None, height, width, 3)
    return ModelFacts(
        "triton", (TensorFacts("", d.input_dtype, shape),), (TensorFacts("", "float32", (None, len(d.labels))),)
    )


def read(d: Declaration, facts: ModelFacts, max_batch_size: int) -> ImageModel:
    """``facts`` checked as a file's are (``service.models.reading.examine``), whose key ``path`` is
    the model in Triton here: ``triton_model``."""
    try:
        return examine(d, facts, max_batch_size)
    except DeclarationError as exc:
        raise _in_triton(exc, d) from None


def complete_facts(d: Declaration, facts: ModelFacts, *, name: str, version: str, max_batch_size: int) -> ModelProfile:
    """The profile of a model in Triton: the declaration completed from ``facts`` and checked
    against them with a file's checks (``DeclarationError`` naming the key and both values)."""
    try:
        return reading.complete_facts(
            d,
            facts,
            name=name,
            version=version,
            max_batch_size=max_batch_size,
            builder=lambda source, size, output: functools.partial(_not_built, name),
            revision=BUILDER_REVISION,
            labels_elsewhere=", or a label_filename for its output in the model's config.pbtxt on Triton",
        )
    except DeclarationError as exc:
        raise _in_triton(exc, d) from None


def _in_triton(exc: DeclarationError, d: Declaration) -> DeclarationError:
    """A file's error about the model (``path``) said of the model in Triton (``triton_model``)."""
    return DeclarationError(str(exc).replace(f"{d.where}: path: ", f"{d.where}: triton_model: ", 1))


def _not_built(name: str, weights: Path | None) -> Any:
    raise ValueError(f"model {name!r} is served by the user's Triton: it has no graph to build here")


def declaration_of(profile: ModelProfile, where: str) -> Declaration:
    """Everything a completed profile says of its model, as a declaration: completed again from
    Triton's metadata, it agrees or says which key does not."""
    source = profile.source
    assert source is not None
    a = source.arithmetic
    numbers = a.dtype != "uint8"
    return Declaration(
        where,
        labels=profile.label_names,
        input_size=profile.input_size,
        color=a.color,
        layout=a.layout,
        input_dtype=a.dtype,
        scale=a.scale if numbers else None,
        mean=a.mean if numbers else None,
        std=a.std if numbers else None,
        output=profile.output,
    )


def check_on_triton(
    profile: ModelProfile, metadata: Mapping[str, Any], max_batch_size: int, where: str
) -> tuple[ModelProfile, None] | tuple[None, str]:
    """The profile completed again from Triton's metadata now (its input and output names filled),
    or why Triton's model does not take what the gateway sends it."""
    try:
        facts = triton_facts(metadata)
        d = declaration_of(profile, where)
        now = complete_facts(d, facts, name=profile.name, version=profile.version, max_batch_size=max_batch_size)
    except MetadataError as exc:
        return None, f"{where}: Triton's metadata is not understood: {exc}"
    except DeclarationError as exc:
        return None, str(exc)
    if now.outputs != profile.outputs:
        return (
            None,
            f"{where}: output: the model gives {now.outputs} numbers per image; it gave {profile.outputs} at start",
        )
    return now, None


def complete_on_triton(
    d: Declaration, settings: Settings, *, name: str, version: str, wait: float | None = None
) -> ModelProfile:
    """The profile of a model in the user's Triton (the catalog's, for ``backend = "triton"``
    without ``path``): from the declaration alone when it says enough, else from what Triton says,
    asked synchronously (a Triton still starting is waited for up to ``wait`` seconds)."""
    from service.backends import triton_metadata as asking

    if settings.triton_shared_memory:
        raise d.error(
            "triton_shared_memory",
            "a model in Triton in its own element type and layout is sent over the socket: set it to false",
        )
    model = settings.triton_model or name
    if answers_itself(d):
        return complete_facts(d, declared_facts(d), name=name, version=version, max_batch_size=settings.max_batch_size)
    with asking.TritonAsker(settings.triton_url, settings.triton_protocol, d.where, wait=wait) as triton:
        found = triton.model(model, settings.triton_model_version)
        try:
            facts = triton_facts(found.metadata)
        except MetadataError as exc:
            raise d.error("triton_model", f"Triton's metadata for {model!r} is not understood: {exc}") from None
        if found.max_batch_size and settings.max_batch_size > found.max_batch_size:
            raise d.error(
                "max_batch_size",
                f"{settings.max_batch_size}; the model {model!r} on Triton takes batches of at most "
                f"{found.max_batch_size} (its config.pbtxt's max_batch_size): set max_batch_size <= "
                f"{found.max_batch_size}",
            )
        output = facts.outputs[0] if facts.outputs else None
        if d.labels is None and (d.output or "softmax") in CLASSIFYING and output and output.name in found.label_files:
            geometry = read(d, facts, settings.max_batch_size)  # checked before an inference is sent
            if geometry.width is not None:
                labels = triton.labels(model, settings.triton_model_version, geometry)
                d = replace(d, labels=_checked_labels(labels, d.where, model))
    return complete_facts(d, facts, name=name, version=version, max_batch_size=settings.max_batch_size)


def _checked_labels(labels: list[str], where: str, model: str) -> tuple[str, ...]:
    """Triton's labels, held to a labels file's rules (count, length, no control characters)."""
    try:
        checked = parse_declaration({"labels": labels}, where, base=Path.cwd(), root=None).labels
    except DeclarationError as exc:
        raise DeclarationError(f"{exc} (the label_filename of {model!r} on Triton)") from None
    assert checked is not None
    return checked
