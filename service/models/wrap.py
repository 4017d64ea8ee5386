"""A user's model behind the gateway's wire: the derived ONNX graph that takes uint8 RGB NHWC images
(``images``, ``[N, H, W, 3]``) and gives float32 rows (``scores``, ``[N, D]``), as a built-in does.

In front of the user's graph: the channel swap for a BGR model and the transpose for an NCHW one
(both on uint8, a quarter of the bytes float32 moves), then the cast and the arithmetic of its
training, ``(x * scale - mean) / std`` per channel in the model's channel order, folded into one
multiply and one add in float32 (``x * (scale / std) + (-mean / std)``), and a cast to float16 last
for a float16 model. After it: a flatten for an ``[N, D, 1, 1]`` head, a cast to float32, and the
softmax (``logits``) or sigmoid (``sigmoid``) the declaration asks for.

The user's graph is kept as it is, in its own operator set (the nodes added exist since opset 7);
its tensors named ``images`` or ``scores`` are renamed, and every added name is new to it. Its file
is read, never written. For an OpenVINO IR the same steps are OpenVINO's own pre- and
post-processing (``derive_openvino``), saved as an IR the openvino backend loads like any other.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.models.declaration import Arithmetic, ModelSource
from service.models.facts import (
    ModelContent,
    ModelFacts,
    ModelFileError,
    flattens,
    ir_model,
    load_onnx,
    onnx_facts,
    read_content,
)
from service.models.profiles import OutputKind
from service.models.tensors import INPUT_NAME, OUTPUT_NAME

if TYPE_CHECKING:
    import onnx
    import openvino as ov

BUILDER_REVISION = 2
"""Bumped when the derived graph changes, so derived files are rebuilt."""
PREFIX = "gateway/"
"""Names of the tensors and nodes added to a user's graph start with this."""
HEADS: dict[OutputKind, str | None] = {"softmax": None, "logits": "Softmax", "sigmoid": "Sigmoid", "embedding": None}
"""The operator after the user's output, by the declared output kind."""


def build(
    source: ModelSource, input_size: tuple[int, int], output: OutputKind, weights: Path | None, *, who: str = ""
) -> onnx.ModelProto:
    """The derived graph of a declared ONNX model (``ModelProfile.build``: a declared model is its
    file, so it takes no weights file); ``who``: the model and version, for errors."""
    if weights is not None:
        raise ValueError(f"a declared model is its file ({source.path.name}); it takes no weights file ({weights})")
    if source.format != "onnx":
        raise ValueError(f"{source.path.name}: only an ONNX file is derived as an ONNX graph (this is {source.format})")
    try:
        content = read_content(source.path)
        check_unchanged(content, source)
        return derive(load_onnx(content.data), source, input_size, output)
    except ModelFileError as exc:
        raise ModelFileError(f"{who}{source.path} {exc}") from None


def check_unchanged(content: ModelContent, source: ModelSource) -> None:
    """The file is still the one ``complete`` checked at start (it may have been replaced since,
    by a model of other inputs, outputs or weights): its content, by SHA-256."""
    if source.sha256 and content.digest != source.sha256:
        raise ModelFileError(
            f"is no longer the model checked at start (SHA-256 {source.sha256[:16]}... then, "
            f"{content.digest[:16]}... now): restart the gateway to check it again"
        )


def derive(
    model: onnx.ModelProto, source: ModelSource, input_size: tuple[int, int], output: OutputKind
) -> onnx.ModelProto:
    """``model`` (left as it is) behind the gateway's wire: a new model, checked."""
    import onnx
    from onnx import TensorProto, helper

    facts = onnx_facts(model)
    _check_unchanged(facts, source)
    derived = onnx.ModelProto()
    derived.CopyFrom(model)
    graph = derived.graph
    names = _NameSet(_all_names(graph))
    image_name, output_name = source.input_name, source.output_name
    for ours in (INPUT_NAME, OUTPUT_NAME):
        if ours in names.taken:
            new = names.fresh(f"user/{ours}")
            _rename(graph, ours, new)
            image_name = new if image_name == ours else image_name
            output_name = new if output_name == ours else output_name
    names.taken |= {INPUT_NAME, OUTPUT_NAME}

    image = next(v for v in graph.input if v.name == image_name)
    batch: int | str = 1 if _dims(image)[0] == 1 else "N"
    graph.input.remove(image)
    typed = [image, *(v for v in graph.output if v.name == output_name)]
    if derived.ir_version >= 4:  # inputs with an initializer: constants (only IR 3 needed them listed)
        initialized = {t.name for t in graph.initializer}
        for value in [v for v in graph.input if v.name in initialized]:
            graph.input.remove(value)
    del graph.output[:]
    graph.value_info.extend(typed)  # still typed: ONNX Runtime checks the added nodes give the model its type

    chain = _Chain(names)
    x = _front(chain, source.arithmetic, input_size)
    front = chain.finish(x, image_name)
    constants = chain.constants

    chain = _Chain(names)
    y = output_name
    result = facts.outputs[0]
    if flattens(result):
        y = chain.op("Flatten", [y], axis=1)
    if result.dtype != "float32":
        y = chain.op("Cast", [y], to=TensorProto.FLOAT)
    head = HEADS[output]
    if head == "Softmax":
        y = chain.op("Softmax", [y], axis=1)
    elif head == "Sigmoid":
        y = chain.op("Sigmoid", [y])
    back = chain.finish(y, OUTPUT_NAME)
    constants += chain.constants

    nodes = [*front, *graph.node, *back]
    del graph.node[:]
    graph.node.extend(_needed(nodes, OUTPUT_NAME))
    graph.initializer.extend(constants)
    _drop_unused(graph)
    if derived.ir_version < 4:  # IR 3 lists every initializer among the inputs
        graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in constants)
    height, width = input_size
    width_dim: int | str = result.shape[1] if result.shape is not None and result.shape[1] is not None else "D"
    graph.input.insert(0, helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, [batch, height, width, 3]))
    graph.output.append(helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [batch, width_dim]))
    entry = derived.metadata_props.add()
    entry.key, entry.value = "inference-gateway.derived_from", source.path.name
    onnx.checker.check_model(derived)
    return derived


def _front(chain: _Chain, arithmetic: Arithmetic, input_size: tuple[int, int]) -> str:
    """The nodes from the wire's uint8 RGB NHWC images to what the model takes.

    Both the channel swap and the transpose move uint8 (a quarter of float32's bytes), and a swap
    moves whole planes (NCHW's channel axis; an NHWC model's image goes there and back for it: a
    gather of every third byte costs 7 times as much). The per-channel constants broadcast over
    long rows: NCHW's planes, or an NHWC image seen as ``[N, H, W * 3]`` with the three constants
    repeated W times (broadcast over a last axis of 3, ONNX Runtime took 5 times as long)."""
    from onnx import TensorProto

    height, width = input_size
    x = INPUT_NAME
    if arithmetic.layout == "NCHW" or arithmetic.color == "BGR":
        x = chain.op("Transpose", [x], perm=[0, 3, 1, 2])
    if arithmetic.color == "BGR":
        x = chain.op("Gather", [x, chain.constant("bgr", np.array([2, 1, 0], np.int64))], axis=1)
        if arithmetic.layout == "NHWC":
            x = chain.op("Transpose", [x], perm=[0, 2, 3, 1])
    if arithmetic.dtype == "uint8":
        return x
    std = np.asarray(arithmetic.std, np.float64)
    factor = (arithmetic.scale / std).astype(np.float32)
    offset = (-np.asarray(arithmetic.mean, np.float64) / std).astype(np.float32)
    rows = arithmetic.layout == "NHWC" and not (np.all(factor == factor[0]) and np.all(offset == offset[0]))
    if rows:
        x = chain.op("Reshape", [x, chain.constant("rows", np.array([0, height, width * 3], np.int64))])
        factor, offset = np.tile(factor, width), np.tile(offset, width)
    elif arithmetic.layout == "NCHW":
        factor, offset = factor.reshape(1, 3, 1, 1), offset.reshape(1, 3, 1, 1)
    else:  # the same for every channel: one number
        factor, offset = factor[:1], offset[:1]
    x = chain.op("Cast", [x], to=TensorProto.FLOAT)
    if np.any(factor != 1):
        x = chain.op("Mul", [x, chain.constant("factor", factor)])
    if np.any(offset != 0):
        x = chain.op("Add", [x, chain.constant("offset", offset)])
    if arithmetic.dtype == "float16":
        x = chain.op("Cast", [x], to=TensorProto.FLOAT16)
    if rows:
        x = chain.op("Reshape", [x, chain.constant("image", np.array([0, height, width, 3], np.int64))])
    return x


def _check_unchanged(facts: ModelFacts, source: ModelSource) -> None:
    """What the model read says still fits ``source`` (a last check, after ``check_unchanged``'s of
    its content: a source without a recorded content is checked by its facts alone)."""
    image = facts.inputs[0] if len(facts.inputs) == 1 else None
    ok = (
        image is not None
        and image.name == source.input_name
        and image.dtype == source.arithmetic.dtype
        and image.shape is not None
        and len(image.shape) == 4
        and image.shape[1 if source.arithmetic.layout == "NCHW" else 3] == 3
        and facts.outputs[0].name == source.output_name
    )
    if not ok:
        raise ModelFileError(
            "is no longer the model checked at start (its input or output changed): restart the gateway to "
            "check it again"
        )


def _dims(value: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]


class _NameSet:
    """The names a graph uses, and new ones: ``gateway/<stem>``, numbered if taken."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken

    def fresh(self, stem: str) -> str:
        name, n = f"{PREFIX}{stem}", 1
        while name in self.taken:
            n += 1
            name = f"{PREFIX}{stem}_{n}"
        self.taken.add(name)
        return name


class _Chain:
    """Nodes in a line, each taking the last one's output, and their constants (initializers: a
    Constant node takes no integers before opset 9)."""

    def __init__(self, names: _NameSet) -> None:
        self.names = names
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def constant(self, stem: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        out = self.names.fresh(stem)
        self.constants.append(numpy_helper.from_array(np.ascontiguousarray(value), out))
        return out

    def op(self, op_type: str, inputs: Sequence[str], **attrs: Any) -> str:
        from onnx import helper

        out = self.names.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.names.fresh(op_type), **attrs))
        return out

    def finish(self, last: str, target: str) -> list[onnx.NodeProto]:
        """The nodes, the last one's output named ``target`` (an Identity if there is none)."""
        from onnx import helper

        if not self.nodes:
            self.nodes.append(helper.make_node("Identity", [last], [target], name=self.names.fresh("Identity")))
        else:
            assert self.nodes[-1].output[0] == last
            self.nodes[-1].output[0] = target
        return self.nodes


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    from onnx import AttributeProto

    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name in ``graph`` and its subgraphs."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names |= {t.name for t in graph.initializer}
    names |= {n for t in graph.sparse_initializer for n in (t.values.name, t.indices.name)}
    for node in graph.node:
        names |= {*node.input, *node.output, node.name}
        for sub in _subgraphs(node):
            names |= _all_names(sub)
    names.discard("")
    return names


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Tensor ``old`` is ``new`` everywhere in ``graph`` and its subgraphs (which may use it)."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == old:
            value.name = new
    tensors = [*graph.initializer, *(t for s in graph.sparse_initializer for t in (s.values, s.indices))]
    for tensor in tensors:
        if tensor.name == old:
            tensor.name = new
    for node in graph.node:
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                if name == old:
                    names[i] = new
        for sub in _subgraphs(node):
            _rename(sub, old, new)


def _used(node: onnx.NodeProto) -> set[str]:
    """What a node reads: its inputs and, for its subgraphs, every name they read (outer ones among them)."""
    used = set(node.input)
    for sub in _subgraphs(node):
        for inner in sub.node:
            used |= _used(inner)
        used |= {v.name for v in sub.output}
    return used


def _needed(nodes: Sequence[onnx.NodeProto], output: str) -> list[onnx.NodeProto]:
    """The nodes (in order) that ``output`` depends on: the user's other outputs are not computed."""
    wanted = {output}
    kept = []
    for node in reversed(nodes):
        if wanted.intersection(node.output):
            kept.append(node)
            wanted |= _used(node)
    return kept[::-1]


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Initializers, value infos and extra inputs that no node reads any more."""
    used = set().union(*(_used(node) for node in graph.node)) if graph.node else set()
    produced = {name for node in graph.node for name in node.output}
    _keep(graph.initializer, lambda t: t.name in used)
    _keep(graph.sparse_initializer, lambda t: t.values.name in used)
    _keep(graph.input, lambda v: v.name in used)
    _keep(graph.value_info, lambda v: v.name in used or v.name in produced)


def _keep(field: Any, keep: Any) -> None:
    for item in [item for item in field if not keep(item)]:
        field.remove(item)


def derive_openvino(
    content: ModelContent, source: ModelSource, input_size: tuple[int, int], output: OutputKind
) -> ov.Model:
    """An OpenVINO IR behind the gateway's wire, by OpenVINO's own pre- and post-processing: the same
    steps as ``derive``'s, on a model read from the content given (the one fingerprinted)."""
    import openvino as ov
    from openvino.preprocess import ColorFormat, PrePostProcessor

    from service.models.facts import openvino_tensor

    model = ir_model(content)
    facts = ModelFacts(
        "openvino", tuple(map(openvino_tensor, model.inputs)), tuple(map(openvino_tensor, model.outputs))
    )
    _check_unchanged(facts, source)
    for result in model.get_results()[1:]:  # the first output is the one served
        model.remove_result(result)
    arithmetic = source.arithmetic
    height, width = input_size
    batch = 1 if facts.inputs[0].shape is not None and facts.inputs[0].shape[0] == 1 else -1
    ppp = PrePostProcessor(model)
    image = ppp.input(0)
    image.tensor().set_element_type(ov.Type.u8).set_layout(ov.Layout("NHWC")).set_shape(
        ov.PartialShape([batch, height, width, 3])
    ).set_color_format(ColorFormat.RGB)
    image.model().set_layout(ov.Layout(arithmetic.layout))
    steps = image.preprocess()
    if arithmetic.color == "BGR":
        steps.convert_color(ColorFormat.BGR)
    if arithmetic.dtype != "uint8":
        steps.convert_element_type(ov.Type.f32)
        factor = [arithmetic.scale / s for s in arithmetic.std]
        offset = [-m / s for m, s in zip(arithmetic.mean, arithmetic.std, strict=True)]
        if any(f != 1 for f in factor):
            steps.scale([1 / f for f in factor])  # OpenVINO divides by its scale
        if any(o != 0 for o in offset):
            steps.mean([-o for o in offset])  # and subtracts its mean
    result = ppp.output(0)
    post = result.postprocess()
    if facts.outputs[0].dtype != "float32":
        post.convert_element_type(ov.Type.f32)
    post.custom(lambda node: _openvino_head(node, flatten=flattens(facts.outputs[0]), output=output))
    result.tensor().set_element_type(ov.Type.f32)
    derived = ppp.build()
    derived.input(0).get_tensor().set_names({INPUT_NAME})
    derived.output(0).get_tensor().set_names({OUTPUT_NAME})
    return derived


def _openvino_head(node: Any, *, flatten: bool, output: OutputKind) -> Any:
    import openvino.opset13 as ops

    if flatten:
        node = ops.reshape(node, ops.constant(np.array([0, -1], np.int64)), special_zero=True).output(0)
    head = HEADS[output]
    if head == "Softmax":
        node = ops.softmax(node, 1).output(0)
    elif head == "Sigmoid":
        node = ops.sigmoid(node).output(0)
    return node
