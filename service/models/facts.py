"""A model file, read: what its inputs and outputs are (``ModelFacts``), from an ONNX file (without
its weights' external data: a model over 2 GB is refused) or an OpenVINO IR (its ``.bin`` beside
it). What the declaration makes of them is ``service.models.reading``'s."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from service.models.declaration import Format
from service.settings.values import NotRegularFile, open_regular, read_at_most

if TYPE_CHECKING:
    import numpy as np
    import onnx
    import openvino as ov

Shape = tuple[int | None, ...]
"""A tensor's dimensions, None where a dimension is dynamic (named, or not given)."""

MAX_ONNX_BYTES = 2**31 - 1
"""Protobuf's limit: an ONNX file past it keeps its weights in external data files."""
MAX_IR_WEIGHTS = 64 * 2**30
"""Largest OpenVINO IR weights file read (an ONNX file's limit is protobuf's 2 GiB)."""
MIN_OPSET = 7
"""The first ONNX operator set whose arithmetic broadcasts as NumPy does (2017)."""

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
    return content_facts(read_content(path))


@dataclass(frozen=True)
class ModelContent:
    """A model file read once: its bytes (an IR: its XML) and an IR's weights, mapped (a ``.bin``
    of gigabytes is not copied into memory), with their SHA-256: what the facts are read from,
    what the derived model is built from, and how a file replaced since start is told apart."""

    path: Path
    data: bytes
    weights: np.ndarray | None = None
    """An IR's ``.bin``, mapped copy-on-write (OpenVINO takes a writable buffer; the file is never written)."""
    weights_sha256: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def digest(self) -> str:
        """The file's content, its weights' included: the SHA-256 of each, space-separated."""
        return self.sha256 if self.weights_sha256 is None else f"{self.sha256} {self.weights_sha256}"


def read_content(path: Path) -> ModelContent:
    """The content of the model file at ``path``, by its suffix; ``ModelFileError`` if unreadable."""
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return ModelContent(path, read_model_bytes(path))
    if suffix == ".xml":
        weights, digest = _map_weights(ir_weights(path))
        return ModelContent(path, read_model_bytes(path), weights, digest)
    if suffix == ".pt2":
        raise ModelFileError("is a torch .pt2 file: not served yet; export the model to ONNX with torch.onnx.export")
    raise ModelFileError("is not a model file: .onnx, an OpenVINO IR .xml or a torch .pt2")


def content_facts(content: ModelContent) -> ModelFacts:
    if content.weights is None:
        return onnx_facts(load_onnx(content.data))
    model = ir_model(content)
    return ModelFacts("openvino", tuple(map(openvino_tensor, model.inputs)), tuple(map(openvino_tensor, model.outputs)))


def _map_weights(path: Path) -> tuple[np.ndarray, str]:
    """An IR's weights mapped, and their SHA-256, hashed streaming (a regular file, bounded)."""
    import numpy as np

    try:
        fd, info = open_regular(path)
    except NotRegularFile:
        raise ModelFileError(f"has weights {path.name} that are not a regular file") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read its weights {path.name}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        if info.st_size > MAX_IR_WEIGHTS:
            raise ModelFileError(f"has weights {path.name} of {info.st_size / 2**30:.1f} GiB, over "
                                 f"{MAX_IR_WEIGHTS / 2**30:.0f} GiB")  # fmt: skip
        digest = hashlib.file_digest(file, "sha256").hexdigest()
        if info.st_size == 0:
            return np.empty(0, np.uint8), digest
        return np.memmap(file, np.uint8, "c", shape=(info.st_size,)), digest


def read_model_bytes(path: Path, limit: int = MAX_ONNX_BYTES) -> bytes:
    """A model file's bytes: a regular file of at most ``limit`` bytes (a FIFO is refused, not waited on;
    past ``MAX_ONNX_BYTES``, protobuf's limit, an ONNX file keeps its weights in external data)."""
    try:
        fd, info = open_regular(path)
    except NotRegularFile:
        raise ModelFileError("is not a regular file") from None
    except OSError as exc:
        raise ModelFileError(f"cannot be read: {exc.strerror}") from None
    try:
        if info.st_size > limit:
            hint = "an ONNX model that large keeps its weights in external data files, not served yet"
            raise ModelFileError(
                f"is {info.st_size / 2**30:.1f} GiB, over {limit / 2**30:.0f} GiB"
                + (f" ({hint})" if limit == MAX_ONNX_BYTES else "")
            )
        data = read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ModelFileError(f"grew past {limit / 2**30:.0f} GiB while it was read")
    return data


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
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in _tensors(model)):
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


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a model holds: its graph's initializers and sparse initializers, its Constant
    nodes' (dense and sparse) and every other tensor attribute, in its subgraphs and in its local
    functions too (any of them may name an external data file, which the runtime would read)."""
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)
    yield from _graph_tensors(model.graph)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        for sparse in [attr.sparse_tensor] * attr.HasField("sparse_tensor") + list(attr.sparse_tensors):
            yield from (sparse.values, sparse.indices)
        for sub in [attr.g] * attr.HasField("g") + list(attr.graphs):
            yield from _graph_tensors(sub)


def ir_weights(path: Path) -> Path:
    """An OpenVINO IR's weights file: its ``.bin`` beside it (OpenVINO loads an IR without one as
    a model without weights, which fails later, or not at all)."""
    weights = path.with_suffix(".bin")
    if not weights.is_file():
        raise ModelFileError(f"needs its weights beside it (an OpenVINO IR's .bin): {weights.name} is not there")
    return weights


def ir_model(content: ModelContent) -> ov.Model:
    """The OpenVINO model of an IR's content (its XML and its mapped weights)."""
    import openvino as ov

    try:
        return ov.Core().read_model(content.data, ov.Tensor(content.weights, shared_memory=True))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable"
        raise ModelFileError(f"is not an OpenVINO IR: {first[:300]}") from None


def openvino_tensor(port: object) -> TensorFacts:
    names = sorted(port.get_names())  # type: ignore[attr-defined]
    name = names[0] if names else port.get_node().get_friendly_name()  # type: ignore[attr-defined]
    kind = port.get_element_type().get_type_name()  # type: ignore[attr-defined]
    shape = port.get_partial_shape()  # type: ignore[attr-defined]
    dims = None
    if shape.rank.is_static:
        dims = tuple(d.get_length() if d.is_static else None for d in shape)
    return TensorFacts(name, _OPENVINO_TYPES.get(kind, kind), dims)


def flattens(output: TensorFacts) -> bool:
    """Whether an output is ``[N, D, 1, 1]`` (a convolutional head), flattened to ``[N, D]``."""
    return output.shape is not None and len(output.shape) == 4 and output.shape[2:] == (1, 1)
