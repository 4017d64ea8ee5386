"""``gateway models check``: a user tries a model of their own before serving it. It prints what the
file says, what the declaration adds (and where each value came from) and the answers for photos,
through the same preprocessing, derived graph and backend as ``serve``; a bad declaration or file
fails with the message ``serve`` would give, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.conftest import encode


def _channel_means(path: Path, layout: str = "NCHW") -> None:
    """A model answering each channel's mean: its 'labels' are the channels, so a photo's answer
    says which colour reached which output."""
    dims = ["N", 3, 32, 48] if layout == "NCHW" else ["N", 32, 48, 3]
    nodes = [helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3] if layout == "NCHW" else [1, 2], keepdims=0)]
    graph = helper.make_graph(
        nodes,
        "means",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def _check(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "models", "check", *args, "--models-dir", str(cwd / "cache")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _channel_means(tmp_path / "means.onnx")
    (tmp_path / "labels.txt").write_text("red\ngreen\nblue\n")
    red = np.zeros((120, 200, 3), np.uint8)
    red[..., 0] = 250
    (tmp_path / "red.jpg").write_bytes(encode(red))
    blue = np.zeros((90, 60, 3), np.uint8)
    blue[..., 2] = 250
    (tmp_path / "blue.png").write_bytes(encode(blue, ".png"))
    return tmp_path


def test_check_says_what_the_file_says_what_is_declared_and_answers_photos(folder: Path) -> None:
    result = _check(folder, "means.onnx", "--labels", "labels.txt", "--photo", "red.jpg", "--photo", "blue.png")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "input  'x' [?, 3, 32, 48] float32" in out
    assert "output 'y' [?, 3] float32" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "32 x 48" in rows["input_size"]
    assert rows["input_size"].endswith("from the file")
    assert rows["layout"].endswith("from the file")
    assert "NCHW" in rows["layout"]
    assert rows["labels"].endswith("declared")
    assert rows["scale"].endswith("default")
    assert "'images' [N, 32, 48, 3] uint8 RGB" in out
    answers = {line.split(":")[0]: line for line in out.splitlines() if line.startswith(("red.jpg", "blue.png"))}
    assert answers["red.jpg"].split(": ")[1].startswith("red 0.98"), answers  # 250/255, the mean of the red channel
    assert answers["blue.png"].split(": ")[1].startswith("blue 0.98"), answers


def test_check_follows_a_declared_colour_order(folder: Path) -> None:
    """color = BGR: the model's first channel is blue, so the red photo's red lands on 'blue'."""
    result = _check(folder, "means.onnx", "--labels", "labels.txt", "--color", "BGR", "--photo", "red.jpg")
    assert result.returncode == 0, result.stderr
    assert "red.jpg: blue 0.98" in result.stdout
    assert "declared" in next(line for line in result.stdout.splitlines() if line.startswith("  color"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-size", "64"], "input_size: [64, 64] declared; the model's input 'x' [?, 3, 32, 48] float32"),
        (["--layout", "NHWC"], 'layout: "NHWC" declared'),
        ([], 'labels: output = "softmax" answers labels: give them (the model gives 3)'),
        (["--std", "0"], "std: [0.0, 0.0, 0.0]: every value must be above 0"),
        (["--mean", "nan"], "mean: must be a finite number"),
        (["--output", "embedding", "--labels", "labels.txt"], "labels: an embedding model"),
    ],
)
def test_check_refuses_a_bad_declaration_as_serve_would(folder: Path, args: list[str], message: str) -> None:
    if "--labels" not in args and "--output" not in args and message.startswith(("input", "layout", "std", "mean")):
        args = [*args, "--labels", "labels.txt"]
    result = _check(folder, "means.onnx", *args)
    assert result.returncode == 1
    assert "model 'means' version '1'" in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_check_refuses_a_file_that_is_not_a_model(folder: Path) -> None:
    (folder / "notes.onnx").write_text("not a model\n")
    (folder / "cut.onnx").write_bytes((folder / "means.onnx").read_bytes()[:40])
    for name in ("notes.onnx", "cut.onnx"):
        result = _check(folder, name, "--labels", "labels.txt")
        assert result.returncode == 1
        assert "path:" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_check_says_which_photo_it_could_not_read(folder: Path) -> None:
    result = _check(folder, "means.onnx", "--labels", "labels.txt", "--photo", "labels.txt", "--photo", "red.jpg")
    assert result.returncode == 1
    assert "labels.txt: not a recognised image" in result.stdout
    assert "red.jpg: red" in result.stdout


def test_check_notes_softmax_scores_that_are_not_probabilities(folder: Path) -> None:
    """The most common slip: a model ending in logits declared as softmax (the default)."""
    declared = _check(folder, "means.onnx", "--labels", "labels.txt", "--scale", "1", "--photo", "red.jpg")
    assert declared.returncode == 0, declared.stderr
    assert 'note: output = "softmax" says the model gives probabilities' in declared.stdout
    assert 'declare output = "logits"' in declared.stdout
    logits = _check(
        folder, "means.onnx", "--labels", "labels.txt", "--scale", "1", "--output", "logits", "--photo", "red.jpg"
    )
    assert "note:" not in logits.stdout
    assert "red.jpg: red 1.000" in logits.stdout


def test_photos_are_read_bounded_one_error_line_each(folder: Path) -> None:
    """A FIFO (never opened for reading: it would hang), a device (/dev/zero: unbounded) and a
    sparse file larger than max_body_bytes (never read whole) each get an error line; the good
    photo after them still answers; the status is 1."""
    import os

    os.mkfifo(folder / "fifo.jpg")
    with (folder / "huge.jpg").open("wb") as f:
        f.truncate(3 * 2**30)
    photos = ["fifo.jpg", "/dev/zero", "huge.jpg", "missing.jpg", "red.jpg"]
    result = _check(folder, "means.onnx", "--labels", "labels.txt", *(a for p in photos for a in ("--photo", p)))
    assert result.returncode == 1, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if line.split(": ")[0] in photos)
    assert lines["fifo.jpg"] == "fifo.jpg is not a regular file"
    assert lines["/dev/zero"] == "/dev/zero is not a regular file"
    assert lines["huge.jpg"] == f"huge.jpg is over {16 * 1024 * 1024} bytes"
    assert lines["missing.jpg"].startswith("No such file or directory")
    assert lines["red.jpg"].startswith("red 0.98")


def test_a_width_other_than_the_labels_and_scores_not_finite_are_said(folder: Path) -> None:
    """A model whose output width is dynamic in its file gives 4 numbers for 3 labels: an error line
    naming both widths (not an IndexError); a model whose scores are inf: a note that says so."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Concat", ["m", "m"], ["wide"], axis=1),
        helper.make_node("Slice", ["wide", "starts", "ends", "axes"], ["y"]),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("starts", 0), ("ends", 4), ("axes", 1))
    ]
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 48])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "D"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "wide.onnx")
    result = _check(folder, "wide.onnx", "--labels", "labels.txt", "--photo", "red.jpg")
    assert result.returncode == 1, result.stderr
    assert "red.jpg: the model gave 4 numbers for this image; it was checked for 3 (3 labels)" in result.stdout
    assert "IndexError" not in result.stdout + result.stderr

    model.graph.node[2].CopyFrom(helper.make_node("Div", ["m", "zero"], ["y"]))
    del model.graph.initializer[:]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), "zero"))
    onnx.save(model, folder / "inf.onnx")
    result = _check(folder, "inf.onnx", "--labels", "labels.txt", "--output", "logits", "--photo", "red.jpg")
    assert "note: 3 of the 3 scores are not finite (inf or NaN)" in result.stdout, result.stdout + result.stderr
