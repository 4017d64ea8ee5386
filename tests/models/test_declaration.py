"""A declared model's keys, each checked on its own before its file is read: hostile values (NaN,
inf, a std of 0, a labels file of 10 MB or of invalid UTF-8, a path outside the models root, through
a symlink too) are refused with the model, the version and the key named, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from service.models.declaration import (
    MAX_LABELS_BYTES,
    Declaration,
    DeclarationError,
    parse_declaration,
)

WHERE = "models.toml: model 'cars' version '1'"


def _parse(tmp_path: Path, root: Path | None = None, **keys: Any) -> Declaration:
    return parse_declaration(keys, WHERE, base=tmp_path, root=root)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "cars.onnx"
    path.write_bytes(b"onnx bytes")  # the file is read later (service.models.reading); here it must exist
    return path


def test_a_full_declaration_is_read_as_given(tmp_path: Path, model_file: Path) -> None:
    (tmp_path / "cars.txt").write_text("sedan\nhatchback\r\nvan\n")
    d = _parse(
        tmp_path,
        path="cars.onnx",
        labels="cars.txt",
        input_size=[260, 200],
        resize="letterbox",
        color="bgr",
        layout="nhwc",
        input_dtype="float16",
        scale=1,
        mean=[103.939, 116.779, 123.68],
        std=1,
        output="sigmoid",
        threshold=0.3,
    )
    assert d.path == model_file.resolve()
    assert d.format == "onnx"
    assert d.labels == ("sedan", "hatchback", "van")
    assert (d.input_size, d.resize, d.color, d.layout, d.input_dtype) == (
        (260, 200),
        "letterbox",
        "BGR",
        "NHWC",
        "float16",
    )
    assert (d.scale, d.mean, d.std) == (1.0, (103.939, 116.779, 123.68), (1.0, 1.0, 1.0))
    assert (d.output, d.threshold) == ("sigmoid", 0.3)
    assert _parse(tmp_path, path="cars.onnx", input_size=300).input_size == (300, 300)


def test_labels_come_from_a_json_list_or_the_file_itself(tmp_path: Path, model_file: Path) -> None:
    (tmp_path / "labels.json").write_text(json.dumps(["a: first", "b, second", "ünïcode"]))
    assert _parse(tmp_path, path="cars.onnx", labels="labels.json").labels == ("a: first", "b, second", "ünïcode")
    assert _parse(tmp_path, path="cars.onnx", labels=["x", "y"]).labels == ("x", "y")


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"mean": [0.5, float("nan"), 0.5]}, "mean: must be a finite number"),
        ({"std": [0.2, float("inf"), 0.2]}, "std: must be a finite number"),
        ({"std": [0.229, 0, 0.225]}, r"std: \[0.229, 0.0, 0.225\]: every value must be above 0"),
        ({"std": -1}, "std: .*above 0"),
        ({"scale": 0}, "scale: 0.0 is not above 0"),
        ({"scale": float("nan")}, "scale: must be a finite number"),
        ({"scale": 1e300}, "scale: .* too large"),
        ({"scale": True}, "scale: must be a finite number"),
        ({"mean": [1, 2]}, "mean: must be one number or three"),
        ({"mean": "0.5"}, "mean: must be a finite number"),
        ({"input_size": 0}, "input_size: must be a side or"),
        ({"input_size": [224, 224, 3]}, "input_size: must be a side or"),
        ({"input_size": 100_000}, "input_size: .* from 1 to 4096"),
        ({"input_size": 224.5}, "input_size"),
        ({"resize": "squash"}, "resize: 'squash' is not one of crop, stretch, letterbox"),
        ({"resize": "stretch", "crop_fraction": 0.9}, 'crop_fraction: applies to resize = "crop"'),
        ({"crop_fraction": 0}, r"crop_fraction: 0.0 is not in \(0, 1\]"),
        ({"crop_fraction": 1.5}, "crop_fraction"),
        ({"color": "RGBA"}, "color: 'RGBA' is not one of RGB, BGR"),
        ({"layout": "NCWH"}, "layout"),
        ({"input_dtype": "int64"}, "input_dtype: 'int64' is not one of uint8, float32, float16"),
        ({"input_dtype": "uint8", "mean": 127}, 'mean: input_dtype = "uint8" takes the pixels as they are'),
        ({"output": "probabilities"}, "output: 'probabilities' is not one of softmax, logits, sigmoid, embedding"),
        ({"threshold": 0.5}, 'threshold: applies to output = "sigmoid"'),
        ({"output": "sigmoid", "threshold": 1.5}, r"threshold: 1.5 is not in \[0, 1\]"),
        ({"output": "embedding", "labels": ["a"]}, "labels: an embedding model"),
        ({"labels": []}, "labels: holds no labels"),
        ({"labels": ["a", 3]}, "labels: label 2 is not a string"),
        ({"labels": ["a", "b\x00c"]}, "labels: label 2 holds a control character"),
        ({"labels": ["x" * 600]}, "labels: label 1 is 600 characters long"),
        ({"resize": "x" * 10_000}, "resize: this value is not one of"),
    ],
)
def test_a_hostile_key_is_refused_by_model_version_and_key(
    tmp_path: Path, model_file: Path, keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(DeclarationError, match=f"^{WHERE}: {message}"):
        _parse(tmp_path, path="cars.onnx", **keys)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"a\nb\n" * (MAX_LABELS_BYTES // 4 + 1), "is over 4194304 bytes"),
        (b"cat\n\xff\xfedog\n", r"is not UTF-8 \(byte 4\)"),
        (b"", "holds no labels"),
        (b"\n", "holds no labels"),
        (b"a\n" * 100_001, "holds 100001 labels; at most 100000"),
    ],
)
def test_a_hostile_labels_file_is_refused(tmp_path: Path, model_file: Path, content: bytes, message: str) -> None:
    (tmp_path / "labels.txt").write_bytes(content)
    with pytest.raises(DeclarationError, match=f"^{WHERE}: labels: .*{message}"):
        _parse(tmp_path, path="cars.onnx", labels="labels.txt")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"a": 1}', "must hold a JSON list"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1, 2]", "label 1 is not a string"),
    ],
)
def test_a_hostile_json_labels_file_is_refused(tmp_path: Path, model_file: Path, content: bytes, message: str) -> None:
    (tmp_path / "labels.json").write_bytes(content)
    with pytest.raises(DeclarationError, match=f"^{WHERE}: labels: .*{message}"):
        _parse(tmp_path, path="cars.onnx", labels="labels.json")


def test_files_outside_the_models_root_are_refused_symlinks_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.onnx").write_bytes(b"x")
    (outside / "labels.txt").write_text("a\n")
    (root / "inside.onnx").write_bytes(b"x")
    os.symlink(outside / "secret.onnx", root / "link.onnx")
    assert _parse(root, root=root, path="inside.onnx").path == (root / "inside.onnx").resolve()
    for path in ("../elsewhere/secret.onnx", str(outside / "secret.onnx"), "link.onnx"):
        with pytest.raises(DeclarationError, match=f"^{WHERE}: path: .* is outside the models root"):
            _parse(root, root=root, path=path)
    with pytest.raises(DeclarationError, match=r"labels: .* is outside the models root"):
        _parse(root, root=root, path="inside.onnx", labels="../elsewhere/labels.txt")


@pytest.mark.parametrize("weights", ["link", "dangling", "fifo"])
def test_an_ir_whose_weights_are_outside_the_models_root_or_not_a_file_is_refused(tmp_path: Path, weights: str) -> None:
    """An OpenVINO IR's .bin is read too: a symlink out of the models root (even to nowhere) or a
    FIFO is refused by the same rule as ``path``."""
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"x")
    (root / "m.xml").write_text("<net/>")
    if weights == "link":
        os.symlink(outside / "secret.bin", root / "m.bin")
    elif weights == "dangling":
        os.symlink(outside / "gone.bin", root / "m.bin")
    else:
        os.mkfifo(root / "m.bin")
    problem = "is outside the models root" if weights != "fifo" else "is not a file"
    with pytest.raises(DeclarationError, match=f"^{WHERE}: path: .*m\\.bin.* {problem}"):
        _parse(root, root=root, path="m.xml")
    (root / "m.bin").unlink()
    (root / "m.bin").write_bytes(b"")
    assert _parse(root, root=root, path="m.xml").path == (root / "m.xml").resolve()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.onnx", "is not a file"),
        ("", "must be a file path"),
        (7, "must be a file path"),
        ("a\x00b.onnx", "NUL byte"),
        ("cars.bin", "a model file is .onnx, an OpenVINO IR .xml or a torch .pt2"),
        (".", "is not a file"),
    ],
)
def test_a_bad_path_is_refused(tmp_path: Path, path: Any, message: str) -> None:
    (tmp_path / "cars.bin").write_bytes(b"x")
    with pytest.raises(DeclarationError, match=f"^{WHERE}: path: .*{message}"):
        _parse(tmp_path, path=path)


def test_a_fifo_as_labels_is_refused_without_blocking(tmp_path: Path, model_file: Path) -> None:
    os.mkfifo(tmp_path / "labels.txt")
    with pytest.raises(DeclarationError, match=r"labels: .*is not a file|is not a regular file"):
        _parse(tmp_path, path="cars.onnx", labels="labels.txt")
