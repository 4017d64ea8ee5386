"""Declared models: hostile files and declarations are refused at start with one sentence naming
the model, the version, the key and both values (never a traceback); the derived file is rebuilt
when the user's file or the declaration changes, and only then."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import openvino as ov
import pytest

from service.models.declaration import DeclarationError, parse_declaration
from service.models.facts import ModelFileError
from service.models.profiles import ModelProfile
from service.models.reading import complete
from service.models.store import ensure_model, model_bytes, model_path
from tests.models.exports import tiny_model

WHERE = "models.toml: model 'cars' version '2'"
NCHW: list[int | str | None] = ["N", 3, 8, 8]


def declare(folder: Path, file: str = "m.onnx", *, max_batch_size: int = 16, **keys: Any) -> ModelProfile:
    declaration = parse_declaration({"path": file, **keys}, WHERE, base=folder, root=None)
    return complete(declaration, name="cars", version="2", max_batch_size=max_batch_size)


def refused(folder: Path, key: str, *fragments: str, file: str = "m.onnx", **keys: Any) -> str:
    """The declaration is refused: the message starts with who declared it and the key, and names each fragment."""
    with pytest.raises(DeclarationError) as caught:
        declare(folder, file, **keys)
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: {key}: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "Traceback" not in message
    return message


def save(folder: Path, model: onnx.ModelProto, name: str = "m.onnx") -> Path:
    path = folder / name
    onnx.save(model, path)
    return path


LABELS = [f"label {i}" for i in range(10)]


def test_a_well_declared_model_is_completed_from_its_file(tmp_path: Path) -> None:
    """What the declaration leaves out comes from the file: layout, size, element type, width."""
    save(tmp_path, tiny_model(["batch", 8, 12, 3], outputs=10))
    profile = declare(tmp_path, labels=LABELS)
    assert profile.source is not None
    assert (profile.name, profile.version, profile.input_size) == ("cars", "2", (8, 12))
    assert (profile.source.input_name, profile.source.output_name, profile.source.format) == ("x", "y", "onnx")
    arithmetic = profile.source.arithmetic
    assert (arithmetic.layout, arithmetic.dtype, arithmetic.color) == ("NHWC", "float32", "RGB")
    assert (arithmetic.scale, arithmetic.mean, arithmetic.std) == (1 / 255, (0.0,) * 3, (1.0,) * 3)
    assert (profile.output, profile.resize, profile.crop_fraction, profile.threshold) == ("softmax", "crop", 0.875, 0.5)
    assert profile.outputs == 10
    assert profile.labels == tuple(LABELS)


def test_a_uint8_model_takes_the_pixels_as_they_are(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW, dtype="uint8"))
    assert declare(tmp_path, labels=LABELS).source.arithmetic.identity  # type: ignore[union-attr]
    refused(tmp_path, "scale", "takes uint8", "'x' [?, 3, 8, 8] uint8", labels=LABELS, scale=1)
    refused(tmp_path, "mean", "takes uint8", labels=LABELS, mean=[1, 2, 3])


def test_a_truncated_onnx_file(tmp_path: Path) -> None:
    data = tiny_model(NCHW).SerializeToString()
    (tmp_path / "m.onnx").write_bytes(data[: len(data) // 2])
    refused(tmp_path, "path", "m.onnx is not an ONNX model", "truncated", labels=LABELS)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"name,label\ncat,1\n", "does not parse"),
        (b"", "no graph"),
        (b"\x08\x07", "no graph"),  # a valid protobuf: ir_version 7 and nothing else
        (bytes(1000), "does not parse"),
    ],
    ids=["text", "empty", "just-a-version", "zeros"],
)
def test_a_file_named_onnx_that_is_not_a_model(tmp_path: Path, content: bytes, says: str) -> None:
    (tmp_path / "m.onnx").write_bytes(content)
    refused(tmp_path, "path", "m.onnx is not an ONNX model", says, labels=LABELS)


def test_two_image_inputs(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW, extra_inputs=1))
    refused(tmp_path, "path", "takes 2 inputs", "'x' [?, 3, 8, 8] float32", "'extra0'", "feeds one", labels=LABELS)


def test_an_input_that_is_not_an_image(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(["N", 3, 64]))
    refused(tmp_path, "path", "'x' [?, 3, 64] float32 has rank 3", labels=LABELS)
    save(tmp_path, tiny_model(NCHW, dtype="int64"))
    refused(tmp_path, "input_dtype", "takes int64", "uint8, float32, float16", labels=LABELS)


@pytest.mark.parametrize(
    ("shape", "layout"),
    [(["N", "C", 224, 224], "NCHW"), (["N", 224, 224, "C"], "NHWC"), (["N", "C", "H", "W"], "NCHW")],
)
def test_a_dynamic_channel_count(tmp_path: Path, shape: list[int | str | None], layout: str) -> None:
    """Undeclared or declared, a channel axis that is not fixed at 3 is refused."""
    save(tmp_path, tiny_model(shape))
    refused(tmp_path, "layout", "dynamic channel count", "it must be fixed at 3", labels=LABELS)
    refused(tmp_path, "layout", "dynamic channel count", labels=LABELS, layout=layout, input_size=224)


@pytest.mark.parametrize(("shape", "channels"), [(["N", 1, 28, 28], 1), (["N", 28, 28, 1], 1), (["N", 4, 8, 8], 4)])
def test_a_model_that_is_not_rgb(tmp_path: Path, shape: list[int | str | None], channels: int) -> None:
    """A grey (1 channel) or RGBA (4) model declared as an RGB or BGR one: both counts named."""
    save(tmp_path, tiny_model(shape))
    noun = "channel" if channels == 1 else "channels"
    refused(tmp_path, "color", f"takes {channels} {noun}", "RGB images have 3", labels=LABELS)
    refused(tmp_path, "color", f"takes {channels} {noun}", "BGR images have 3", labels=LABELS, color="BGR")


def test_labels_that_do_not_match_the_output(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW, outputs=10))
    refused(
        tmp_path, "labels", "1000 labels for 10 outputs", "'y' [?, 10] float32", labels=[str(i) for i in range(1000)]
    )
    refused(tmp_path, "labels", 'output = "softmax" answers labels', "the model gives 10")
    refused(tmp_path, "labels", 'output = "sigmoid"', output="sigmoid")


def test_the_input_size_disagrees(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(["N", 3, 260, 260]))
    refused(tmp_path, "input_size", "[224, 224] declared", "'x' [?, 3, 260, 260] float32", "height 260", labels=LABELS,
            input_size=224)  # fmt: skip
    refused(tmp_path, "input_size", "[260, 300] declared", "width 260", labels=LABELS, input_size=[260, 300])
    assert declare(tmp_path, labels=LABELS, input_size=260).input_size == (260, 260)


def test_a_dynamic_size_needs_input_size(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(["N", 3, "H", "W"]))
    refused(tmp_path, "input_size", "dynamic height or width", "declare input_size", labels=LABELS)
    assert declare(tmp_path, labels=LABELS, input_size=[240, 320]).input_size == (240, 320)


def test_the_layout_disagrees(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW))
    refused(tmp_path, "layout", '"NHWC" declared (channels on axis 3)', "'x' [?, 3, 8, 8] float32 is NCHW",
            labels=LABELS, layout="NHWC")  # fmt: skip
    save(tmp_path, tiny_model(["N", 3, 8, 3]))
    refused(tmp_path, "layout", "may be NCHW or NHWC: declare which", labels=LABELS)
    assert declare(tmp_path, labels=LABELS, layout="NHWC").source.arithmetic.layout == "NHWC"  # type: ignore[union-attr]


def test_the_element_type_disagrees(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW))
    refused(tmp_path, "input_dtype", '"float16" declared', "'x' [?, 3, 8, 8] float32 takes float32",
            labels=LABELS, input_dtype="float16")  # fmt: skip
    refused(tmp_path, "input_dtype", '"uint8" declared', "takes float32", labels=LABELS, input_dtype="uint8")


def test_a_fixed_batch(tmp_path: Path) -> None:
    """A batch of 1 needs max_batch_size = 1 (said so); a fixed batch of more is refused outright."""
    save(tmp_path, tiny_model([1, 3, 8, 8]))
    refused(tmp_path, "max_batch_size", "'x' [1, 3, 8, 8] float32 takes one image at a time", "max_batch_size is 16",
            "set max_batch_size = 1", labels=LABELS)  # fmt: skip
    assert declare(tmp_path, labels=LABELS, max_batch_size=1).input_size == (8, 8)
    save(tmp_path, tiny_model([8, 3, 8, 8]))
    refused(tmp_path, "path", "batches of exactly 8", "dynamic batch axis", labels=LABELS, max_batch_size=8)


def test_outputs_that_are_not_rows(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW, out_shape=["N", 10, 7]))
    refused(tmp_path, "output", "'y' [?, 10, 7] float32 is not rows of scores", labels=LABELS)
    save(tmp_path, tiny_model(NCHW, out_dtype="int64"))
    refused(tmp_path, "output", "is int64", "floating point", labels=LABELS)
    save(tmp_path, tiny_model(NCHW, out_shape=["N", "D"]))
    refused(tmp_path, "output", "dynamic width", output="embedding")
    assert declare(tmp_path, labels=LABELS).outputs == 10  # labelled: the labels say the width


def test_an_embedding_is_sized_by_its_output(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW, outputs=1280, out_rank=4))
    profile = declare(tmp_path, output="embedding")
    assert (profile.outputs, profile.classifies, profile.label_names) == (1280, False, None)


def test_an_old_operator_set_and_external_data(tmp_path: Path) -> None:
    model = tiny_model(NCHW)
    model.opset_import[0].version = 6
    save(tmp_path, model)
    refused(tmp_path, "path", "operator set 6", "needs 7 or later", "onnx.version_converter", labels=LABELS)
    model = tiny_model(NCHW)
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.zeros(4096, np.int64), "rows"))
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0, location="m.data")
    refused(tmp_path, "path", "external data files", labels=LABELS)


def test_an_openvino_ir_without_its_weights(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW))
    ov.save_model(ov.convert_model(tmp_path / "m.onnx"), str(tmp_path / "m.xml"))
    assert declare(tmp_path, "m.xml", labels=LABELS).source.format == "openvino"  # type: ignore[union-attr]
    (tmp_path / "m.bin").unlink()
    refused(tmp_path, "path", "m.xml needs its weights beside it", "m.bin is not there", file="m.xml", labels=LABELS)
    (tmp_path / "m.bin").write_bytes(b"")
    (tmp_path / "m.xml").write_text("<net>not quite</net")
    refused(tmp_path, "path", "m.xml is not an OpenVINO IR", file="m.xml", labels=LABELS)


def test_a_torch_file(tmp_path: Path) -> None:
    (tmp_path / "m.pt2").write_bytes(b"PK\x03\x04")
    refused(tmp_path, "path", "m.pt2 is a torch .pt2 file", "torch.onnx.export", file="m.pt2", labels=LABELS)


def test_the_derived_file_is_rebuilt_when_the_file_or_the_declaration_changes(tmp_path: Path) -> None:
    """Reused as long as nothing changed (not even rewritten); a new file or a new mean rebuilds it;
    the derived file sits under declared/<name>/<version>."""
    models = tmp_path / "models"
    source = save(tmp_path, tiny_model(NCHW))
    profile = declare(tmp_path, labels=LABELS, mean=0.5)
    path = ensure_model(models, profile)
    assert path == model_path(models, profile) == models / "declared" / "cars" / "2" / "model.onnx"
    assert model_bytes(models, profile) == path.stat().st_size
    meta = json.loads(path.with_name("build.json").read_text())
    assert meta["file"]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert meta["declaration"]["arithmetic"]["mean"] == [0.5, 0.5, 0.5]
    os.utime(path, ns=(0, 0))
    assert ensure_model(models, declare(tmp_path, labels=LABELS, mean=0.5)) == path
    assert path.stat().st_mtime_ns == 0, "rebuilt with nothing changed"

    ensure_model(models, declare(tmp_path, labels=LABELS, mean=0.25))
    assert path.stat().st_mtime_ns != 0, "a new mean was not rebuilt"
    os.utime(path, ns=(0, 0))
    save(tmp_path, tiny_model(NCHW, opset=13))
    ensure_model(models, declare(tmp_path, labels=LABELS, mean=0.25))
    assert path.stat().st_mtime_ns != 0, "a new file was not rebuilt"
    assert onnx.load(path).opset_import[0].version == 13


def test_a_file_changed_since_start_is_refused_at_load(tmp_path: Path) -> None:
    """Checked at start, replaced by another model before the load: the load says so."""
    save(tmp_path, tiny_model(NCHW))
    profile = declare(tmp_path, labels=LABELS)
    save(tmp_path, tiny_model(["N", 8, 8, 3]))
    with pytest.raises(ModelFileError, match=r"model 'cars' version '2': .*m\.onnx is no longer the model checked"):
        ensure_model(tmp_path / "models", profile)
    (tmp_path / "m.onnx").write_bytes(b"garbage")
    with pytest.raises(ModelFileError, match=r"m\.onnx is no longer the model checked"):
        ensure_model(tmp_path / "models", profile)


def test_a_file_replaced_by_one_of_the_same_names_is_refused_at_load(tmp_path: Path) -> None:
    """Replaced after start by a model whose input and output have the same names but another input
    size and 1000 outputs for 10 labels: refused by its content, naming model, version and file,
    whether derived by the store or by the profile's builder (``gateway models triton-repo``)."""
    save(tmp_path, tiny_model(NCHW, outputs=10))
    profile = declare(tmp_path, labels=LABELS)
    save(tmp_path, tiny_model(["N", 3, 16, 16], outputs=1000))
    changed = r"model 'cars' version '2': .*m\.onnx is no longer the model checked at start \(SHA-256"
    with pytest.raises(ModelFileError, match=changed):
        ensure_model(tmp_path / "models", profile)
    with pytest.raises(ModelFileError, match=changed):
        profile.build(None)
    save(tmp_path, tiny_model(NCHW, outputs=10))  # the same content again: served
    assert ensure_model(tmp_path / "models", profile).exists()


def test_an_ir_whose_weights_change_after_start_is_refused_at_load(tmp_path: Path) -> None:
    """An IR's .bin is part of its content: new weights after start are refused at load."""
    save(tmp_path, tiny_model(NCHW))
    ov.save_model(ov.convert_model(tmp_path / "m.onnx"), str(tmp_path / "m.xml"))
    profile = declare(tmp_path, "m.xml", labels=LABELS)
    weights = bytearray((tmp_path / "m.bin").read_bytes())
    weights[-1] ^= 0xFF
    (tmp_path / "m.bin").write_bytes(bytes(weights))
    with pytest.raises(ModelFileError, match=r"model 'cars' version '2': .*m\.xml is no longer the model checked"):
        ensure_model(tmp_path / "models", profile)


def test_a_declared_model_takes_no_weights_file(tmp_path: Path) -> None:
    save(tmp_path, tiny_model(NCHW))
    profile = declare(tmp_path, labels=LABELS)
    with pytest.raises(ValueError, match="takes no weights file"):
        ensure_model(tmp_path / "models", profile, tmp_path / "w.pth")
    with pytest.raises(ValueError, match="takes no weights file"):
        profile.build(tmp_path / "w.pth")
    assert profile.build(None).graph.input[0].name == "images"


def test_an_ir_is_derived_into_an_ir(tmp_path: Path) -> None:
    """A declared IR's derived model is an IR (xml and bin) in declared/<name>/<version>, counted whole."""
    save(tmp_path, tiny_model(NCHW))
    ov.save_model(ov.convert_model(tmp_path / "m.onnx"), str(tmp_path / "m.xml"))
    profile = declare(tmp_path, "m.xml", labels=LABELS)
    path = ensure_model(tmp_path / "models", profile)
    assert path == tmp_path / "models" / "declared" / "cars" / "2" / "model.xml"
    assert model_bytes(tmp_path / "models", profile) == path.stat().st_size + path.with_suffix(".bin").stat().st_size
    model = ov.Core().read_model(path)
    assert [p.get_any_name() for p in model.inputs] == ["images"]
    assert model.input(0).get_element_type() == ov.Type.u8
    assert str(model.input(0).get_partial_shape()) == "[?,8,8,3]"
    with pytest.raises(ValueError, match="only an ONNX file"):
        profile.build(None)


def _external(name: str, location: str) -> onnx.TensorProto:
    from onnx import TensorProto, helper

    tensor = helper.make_tensor(name, TensorProto.FLOAT, [3], [0.0, 0.0, 0.0])
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("length", "12")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _sparse(location: str) -> onnx.SparseTensorProto:
    indices = onnx.numpy_helper.from_array(np.array([0, 1, 2], np.int64), "si")
    return onnx.helper.make_sparse_tensor(_external("sv", location), indices, [10])


@pytest.mark.parametrize("where", ["constant sparse_value", "sparse_initializer", "local function", "subgraph"])
def test_external_data_anywhere_in_the_model_is_refused(tmp_path: Path, where: str) -> None:
    """A tensor naming an external file is refused wherever it sits (a sparse Constant, a sparse
    initializer, a local function's Constant, a subgraph's): the runtime would read that file as
    weights (the gateway's own build.json, /etc/passwd)."""
    from onnx import helper

    model = tiny_model(NCHW)
    graph = model.graph
    if where == "constant sparse_value":
        graph.node.append(helper.make_node("Constant", [], ["spc"], sparse_value=_sparse("build.json")))
    elif where == "sparse_initializer":
        graph.sparse_initializer.append(_sparse("/etc/passwd"))
    elif where == "local function":
        node = helper.make_node("Constant", [], ["c"], value=_external("fc", "build.json"))
        model.functions.append(helper.make_function("local", "f", [], ["c"], [node], [helper.make_opsetid("", 17)]))
        model.opset_import.append(helper.make_opsetid("local", 1))
    else:
        inner = helper.make_graph(
            [helper.make_node("Constant", [], ["b"], sparse_value=_sparse("build.json"))],
            "inner",
            [],
            [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [10])],
        )
        cond = onnx.numpy_helper.from_array(np.array(True), "cond")
        graph.initializer.append(cond)
        graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=inner, else_branch=inner))
    (tmp_path / "build.json").write_text("{}")
    onnx.save(model, tmp_path / "m.onnx")
    refused(tmp_path, "path", "external data files", labels=LABELS)


def test_a_batch_too_large_for_memory_is_refused(tmp_path: Path) -> None:
    """input_size 4096 with max_batch_size 64 is a 12 GiB float32 batch: refused at start naming
    both and what to lower; the same size one image at a time fits."""
    save(tmp_path, tiny_model(["N", 3, "H", "W"]))
    refused(
        tmp_path, "input_size", "4096 x 4096 with max_batch_size 64", "12.0 GiB", "max_batch_size to at most 10",
        labels=LABELS, input_size=4096, max_batch_size=64,
    )  # fmt: skip
    assert declare(tmp_path, labels=LABELS, input_size=4096, max_batch_size=1).input_size == (4096, 4096)


@pytest.mark.parametrize(
    ("dtype", "keys", "key", "fragment"),
    [
        ("float16", {"scale": 1000}, "scale", "float16's range"),
        ("float32", {"std": 1e-38, "scale": 1}, "std", "float32's range"),
        ("float16", {"std": 0.001, "scale": 1}, "std", "255000"),
    ],
)
def test_arithmetic_that_overflows_the_input_type_is_refused(
    tmp_path: Path, dtype: str, keys: dict[str, float], key: str, fragment: str
) -> None:
    """(x * scale - mean) / std past float16's 65504 (a float16 model) or float32's range gives inf
    inputs and NaN answers: refused at start naming scale, mean, std and the range they give."""
    save(tmp_path, tiny_model(NCHW, dtype=dtype))
    refused(tmp_path, key, "scale", "mean", "std", fragment, labels=LABELS, **keys)
    assert declare(tmp_path, labels=LABELS, scale=1, mean=127, std=128).source is not None  # the usual is fine


@pytest.mark.parametrize(
    ("keys", "width", "most"),
    [({"output": "sigmoid", "labels": LABELS}, 100_001, "100000"), ({"output": "embedding"}, 65_537, "65536")],
)
def test_an_output_too_wide_is_refused(tmp_path: Path, keys: dict[str, Any], width: int, most: str) -> None:
    """A file saying its output is wider than any label list (``MAX_LABELS``) or embedding the gateway
    serves is refused by its width, before its labels are counted."""
    save(tmp_path, tiny_model(NCHW, outputs=4, out_shape=["N", width]))
    refused(tmp_path, "output", f"gives {width} numbers per image", f"at most {most}", **keys)
