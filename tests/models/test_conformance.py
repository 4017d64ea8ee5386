"""The derived graph feeds a user's model exactly the tensor its declaration describes.

The model here (``tiny_model(echo=True)``) answers the very tensor it received, flattened, so each
combination of layout, colour order, element type and arithmetic is compared number by number with
an independent NumPy reference computed from the uint8 RGB batch: ``(x * scale - mean) / std`` per
channel in the model's colour order, in float64, then the model's element type. The same for an
OpenVINO IR through OpenVINO's pre- and post-processing, and for the output heads (softmax,
sigmoid, a ``[N, D, 1, 1]`` head, float16 and float64 outputs). Image geometry is not tested here
(the images are the model's size): only the arithmetic.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
import pytest

from service.models.declaration import parse_declaration
from service.models.profiles import ModelProfile
from service.models.reading import complete
from service.models.store import ensure_model
from service.models.wrap import PREFIX
from tests.models.exports import tiny_model

HEIGHT, WIDTH = 5, 7  # not square: a swapped height and width shows
WHERE = "models.toml: model 'tiny' version '1'"
NORMALISATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},  # float: scale 1/255, mean 0, std 1
    "identity": {"scale": 1},
    "torchvision": {"scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
    "caffe": {"scale": 1, "mean": [103.939, 116.779, 123.68]},
    "minus-one-one": {"scale": 1 / 127.5, "mean": 1},
    "lite": {"scale": 1, "mean": 127, "std": 128},
}
CASES = [
    (layout, color, dtype, norm)
    for layout, color, dtype, norm in itertools.product(
        ("NCHW", "NHWC"), ("RGB", "BGR"), ("uint8", "float32", "float16"), NORMALISATIONS
    )
    if dtype != "uint8" or norm == "identity"
]


def batch(n: int = 3, seed: int = 0) -> np.ndarray:
    """uint8 RGB NHWC images, with 0 and 255 among them."""
    rgb = np.random.default_rng(seed).integers(0, 256, (n, HEIGHT, WIDTH, 3), dtype=np.uint8)
    rgb[0, 0, 0], rgb[0, -1, -1] = (0, 0, 0), (255, 255, 255)
    return rgb


def reference(rgb: np.ndarray, layout: str, color: str, dtype: str, keys: dict[str, Any]) -> np.ndarray:
    """What the model must receive, in NumPy: the declaration's arithmetic, written out (float64)."""
    x = rgb.astype(np.float64)
    if color == "BGR":
        x = x[..., ::-1]
    if dtype != "uint8":
        scale = keys.get("scale", 1 / 255)
        mean = np.broadcast_to(np.asarray(keys.get("mean", 0.0), np.float64), (3,))
        std = np.broadcast_to(np.asarray(keys.get("std", 1.0), np.float64), (3,))
        x = (x * scale - mean) / std
    if layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return x.astype(dtype).astype(np.float64).reshape(len(rgb), -1)


def assert_received(got: np.ndarray, expected: np.ndarray, dtype: str, keys: dict[str, Any]) -> None:
    """float32: within two units in the last place of the arithmetic's largest term (folded into
    one multiply-add, with its constants in float32: as a float32 model computes them itself);
    float16: at most one unit in the last place (rounded from float32, not from float64)."""
    assert got.dtype == np.float32
    assert got.shape == expected.shape
    if dtype == "float16":
        ulp = np.spacing(np.abs(expected).astype(np.float16)).astype(np.float64)
        worst = (np.abs(got - expected) / ulp).max()
        assert worst <= 1, f"{worst} float16 ulps off"
    elif dtype == "uint8":
        np.testing.assert_array_equal(got, expected)
    else:
        std = np.asarray(keys.get("std", 1.0), np.float64)
        terms = np.abs(
            np.concatenate([255 * keys.get("scale", 1 / 255) / std, np.asarray(keys.get("mean", 0.0)) / std], axis=None)
        )
        np.testing.assert_allclose(got, expected, rtol=0, atol=2 * float(np.spacing(np.float32(terms.max()))))


def shape_of(layout: str, batch_dim: int | str | None = "N") -> list[int | str | None]:
    return [batch_dim, 3, HEIGHT, WIDTH] if layout == "NCHW" else [batch_dim, HEIGHT, WIDTH, 3]


def declare(folder: Path, file: str, keys: dict[str, Any], *, max_batch_size: int = 16) -> ModelProfile:
    declaration = parse_declaration({"path": file, **keys}, WHERE, base=folder, root=None)
    return complete(declaration, name="tiny", version="1", max_batch_size=max_batch_size)


def run_onnx(path: Path, rgb: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (scores,) = session.run(["scores"], {"images": rgb})
    return np.asarray(scores)


def run_openvino(path: Path, rgb: np.ndarray) -> np.ndarray:
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return np.array(compiled.create_infer_request().infer({0: rgb})[0])


FORMATS = ["onnx", "onnx-on-openvino", "openvino"]
"""The derived ONNX graph on ONNX Runtime (the embedded backend) and on OpenVINO (the openvino
backend runs a declared ONNX file's derived graph), and a declared OpenVINO IR."""


def derived(tmp_path: Path, model: onnx.ModelProto, keys: dict[str, Any], fmt: str = "onnx") -> tuple[Path, Any]:
    """The derived model of ``model`` declared with ``keys`` (``fmt`` "openvino": as an IR), and its runner."""
    onnx.save(model, tmp_path / "tiny.onnx")
    file = "tiny.onnx"
    if fmt == "openvino":
        ov.save_model(ov.convert_model(tmp_path / "tiny.onnx"), str(tmp_path / "tiny.xml"), compress_to_fp16=False)
        file = "tiny.xml"
    path = ensure_model(tmp_path / "models", declare(tmp_path, file, keys))
    if fmt != "openvino":  # strict type and shape inference: the added nodes give the model its input's type
        onnx.checker.check_model(onnx.load(path), full_check=True)
    return path, run_onnx if fmt == "onnx" else run_openvino


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("layout", "color", "dtype", "norm"), CASES)
def test_the_model_receives_what_its_declaration_says(
    tmp_path: Path, fmt: str, layout: str, color: str, dtype: str, norm: str
) -> None:
    """Every layout x colour x element type x arithmetic: the tensor the model receives is the
    NumPy reference's, for an ONNX file (on ONNX Runtime and on OpenVINO) and an OpenVINO IR."""
    keys = dict(NORMALISATIONS[norm]) if dtype != "uint8" else {}
    model = tiny_model(shape_of(layout), dtype=dtype, echo=True, outputs=HEIGHT * WIDTH * 3)
    path, run = derived(tmp_path, model, {"layout": layout, "color": color, "output": "embedding", **keys}, fmt)
    rgb = batch()
    assert_received(run(path, rgb), reference(rgb, layout, color, dtype, keys), dtype, keys)


@pytest.mark.parametrize("opset", [7, 9, 11, 13, 17, 21])
def test_the_users_operator_set_is_kept(tmp_path: Path, opset: int) -> None:
    """From opset 7 (IR 3, initializers listed as inputs) to 21: the derived graph keeps the user's
    operator set, passes the checker's full check, and feeds the model the reference's tensor."""
    keys = {"color": "BGR", **NORMALISATIONS["torchvision"], "output": "logits", "labels": ["a", "b", "c"]}
    model = tiny_model(shape_of("NCHW"), outputs=3, opset=opset)
    path, run = derived(tmp_path, model, keys)
    built = onnx.load(path)
    onnx.checker.check_model(built, full_check=True)
    assert [(o.domain, o.version) for o in built.opset_import] == [("", opset)]
    rgb = batch()
    received = reference(rgb, "NCHW", "BGR", "float32", keys)
    logits = received.mean(axis=1, keepdims=True) * np.arange(1, 4)
    expected = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(run(path, rgb), expected / expected.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("output", "out_dtype", "out_rank"),
    [
        ("softmax", "float32", 2),
        ("logits", "float32", 2),
        ("logits", "float16", 4),
        ("sigmoid", "float64", 2),
        ("sigmoid", "float32", 4),
        ("embedding", "float16", 2),
        ("embedding", "float32", 4),
    ],
)
def test_the_output_head(tmp_path: Path, fmt: str, output: str, out_dtype: str, out_rank: int) -> None:
    """After the model: softmax for ``logits``, sigmoid for ``sigmoid``, nothing for ``softmax`` and
    ``embedding``; an ``[N, D, 1, 1]`` head flattened, any float output cast to float32."""
    model = tiny_model(shape_of("NCHW"), outputs=4, out_dtype=out_dtype, out_rank=out_rank)
    keys: dict[str, Any] = {"output": output}  # scale 1/255: scores of about 0.5 to 2
    if output != "embedding":
        keys["labels"] = ["a", "b", "c", "d"]
    path, run = derived(tmp_path, model, keys, fmt)
    rgb = batch()
    raw = rgb.astype(np.float64).reshape(len(rgb), -1).mean(axis=1, keepdims=True) / 255 * np.arange(1, 5)
    raw = raw.astype(out_dtype).astype(np.float64)
    expected = {
        "softmax": raw,
        "embedding": raw,
        "logits": np.exp(raw - raw.max(1, keepdims=True))
        / np.exp(raw - raw.max(1, keepdims=True)).sum(1, keepdims=True),
        "sigmoid": 1 / (1 + np.exp(-raw)),
    }[output]
    got = run(path, rgb)
    assert got.dtype == np.float32
    assert got.shape == (len(rgb), 4)
    # OpenVINO's CPU plugin drops a float16 output's rounding (the convert to float16 and back)
    rtol = 1e-3 if out_dtype == "float16" and fmt != "onnx" else 1e-5
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-7)


def test_a_graph_using_the_gateways_names_is_renamed_not_confused(tmp_path: Path) -> None:
    """A model whose input is ``images``, whose output is ``scores`` and whose tensors use the
    prefix the derived graph adds: its tensors are renamed where they meet ours, and it still
    receives the reference's tensor."""
    model = tiny_model(
        shape_of("NHWC"), echo=True, outputs=HEIGHT * WIDTH * 3, input_name="images", output_name="scores"
    )
    for node in model.graph.node:  # an inner tensor named as the derived graph names its own
        node.output[:] = [f"{PREFIX}cast" if o == "as_float" else o for o in node.output]
        node.input[:] = [f"{PREFIX}cast" if i == "as_float" else i for i in node.input]
    keys = {"layout": "NHWC", **NORMALISATIONS["caffe"], "color": "BGR", "output": "embedding"}
    path, run = derived(tmp_path, model, keys)
    built = onnx.load(path)
    onnx.checker.check_model(built, full_check=True)
    assert [v.name for v in built.graph.input] == ["images"]
    assert [v.name for v in built.graph.output] == ["scores"]
    outputs = [o for n in built.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs)), "a tensor is produced twice"
    rgb = batch()
    assert_received(run(path, rgb), reference(rgb, "NHWC", "BGR", "float32", keys), "float32", keys)


def test_a_subgraph_reading_the_renamed_input(tmp_path: Path) -> None:
    """A model whose ``If`` branches read its input (named ``images``) from the outer graph: the
    rename reaches into the branches, and the nodes feeding them are kept."""
    from onnx import TensorProto, helper, numpy_helper

    rows = numpy_helper.from_array(np.array([0, -1], np.int64), "rows")
    then = helper.make_graph(
        [helper.make_node("Reshape", ["images", "rows"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, ["N", HEIGHT * WIDTH * 3])],
    )
    otherwise = helper.make_graph(
        [
            helper.make_node("Neg", ["images"], ["negated"]),
            helper.make_node("Reshape", ["negated", "rows"], ["else_out"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, ["N", HEIGHT * WIDTH * 3])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True), "c")),
            helper.make_node("If", ["cond"], ["scores"], then_branch=then, else_branch=otherwise),
        ],
        "branches",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, shape_of("NCHW"))],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", HEIGHT * WIDTH * 3])],
        [rows],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    keys = {**NORMALISATIONS["torchvision"], "output": "embedding"}
    path, run = derived(tmp_path, model, keys)
    rgb = batch()
    assert_received(run(path, rgb), reference(rgb, "NCHW", "RGB", "float32", keys), "float32", keys)


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_the_users_other_outputs_are_not_computed(tmp_path: Path, fmt: str) -> None:
    """The first output is served, alone; the nodes only the others need are left out."""
    from onnx import helper

    model = tiny_model(shape_of("NCHW"), outputs=3)
    graph = model.graph
    graph.node.append(helper.make_node("ReduceMax", ["as_float"], ["side"], keepdims=0))
    graph.output.append(helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, ["N"]))
    path, run = derived(tmp_path, model, {"scale": 1, "labels": ["a", "b", "c"]}, fmt)
    if fmt == "onnx":
        built = onnx.load(path)
        assert "ReduceMax" not in {n.op_type for n in built.graph.node}
        assert [v.name for v in built.graph.output] == ["scores"]
    else:
        assert [p.get_any_name() for p in ov.Core().read_model(path).outputs] == ["scores"]
    assert run(path, batch()).shape == (3, 3)


def test_the_users_file_is_only_read(tmp_path: Path) -> None:
    """Deriving leaves the user's file as it was, byte for byte."""
    model = tiny_model(shape_of("NCHW"), outputs=3)
    onnx.save(model, tmp_path / "tiny.onnx")
    before = (tmp_path / "tiny.onnx").read_bytes()
    ensure_model(tmp_path / "models", declare(tmp_path, "tiny.onnx", {"labels": ["a", "b", "c"]}))
    assert (tmp_path / "tiny.onnx").read_bytes() == before
