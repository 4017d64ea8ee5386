"""The NumPy arithmetic the triton backend does for a model in the user's Triton gives the tensor
its declaration describes, the same numbers as the derived ONNX graph the in-process backends run:
checked against the conformance tests' NumPy reference and against the derived graph itself (a
model that answers the tensor it received), for every layout, colour order, element type and
normalisation; and the output head (softmax, sigmoid, a ``[N, D, 1, 1]`` head, float16 and
float64 outputs) as the derived graph applies it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from service.backends.arithmetic import model_input, rows
from service.models.declaration import Arithmetic
from service.models.store import ensure_model
from tests.models.exports import tiny_model
from tests.models.test_conformance import (
    CASES,
    HEIGHT,
    NORMALISATIONS,
    WIDTH,
    assert_received,
    batch,
    declare,
    reference,
    run_onnx,
    shape_of,
)


@pytest.mark.parametrize(("layout", "color", "dtype", "norm"), CASES)
def test_numpy_feeds_what_the_declaration_says_as_the_derived_graph_does(
    tmp_path: Path, layout: str, color: str, dtype: str, norm: str
) -> None:
    """The reference's tensor within the conformance tests' bounds, and the very numbers the
    derived graph gives the model (ONNX Runtime), in the model's own element type."""
    keys = dict(NORMALISATIONS[norm]) if dtype != "uint8" else {}
    onnx.save(tiny_model(shape_of(layout), dtype=dtype, echo=True, outputs=HEIGHT * WIDTH * 3), tmp_path / "m.onnx")
    profile = declare(tmp_path, "m.onnx", {"layout": layout, "color": color, "output": "embedding", **keys})
    assert profile.source is not None
    rgb = batch()
    fed = model_input(rgb, profile.source.arithmetic)
    assert fed.dtype == np.dtype(dtype)
    assert fed.flags.c_contiguous
    assert fed.shape == ((3, 3, HEIGHT, WIDTH) if layout == "NCHW" else (3, HEIGHT, WIDTH, 3))
    flat = fed.astype(np.float32).reshape(len(rgb), -1)
    assert_received(flat, reference(rgb, layout, color, dtype, keys), dtype, keys)
    np.testing.assert_array_equal(flat, run_onnx(ensure_model(tmp_path / "models", profile), rgb))


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
def test_the_output_head_is_the_derived_graphs(tmp_path: Path, output: str, out_dtype: str, out_rank: int) -> None:
    """The model's raw output made rows as the derived graph makes them: within a float32 rounding."""
    model = tiny_model(shape_of("NCHW"), outputs=4, out_dtype=out_dtype, out_rank=out_rank)
    onnx.save(model, tmp_path / "m.onnx")
    keys: dict[str, Any] = {"output": output}
    if output != "embedding":
        keys["labels"] = ["a", "b", "c", "d"]
    profile = declare(tmp_path, "m.onnx", keys)
    assert profile.source is not None
    rgb = batch()
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (raw,) = session.run(None, {"x": model_input(rgb, profile.source.arithmetic)})
    got = rows(np.asarray(raw), profile.output, 4)
    assert got.dtype == np.float32
    assert got.shape == (len(rgb), 4)
    np.testing.assert_allclose(got, run_onnx(ensure_model(tmp_path / "models", profile), rgb), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2, 5), "float32"), ((2, 4, 2, 1), "float32"), ((2, 4, 1), "float32"), ((8,), "float32"), ((2, 4), "int64")],
)
def test_rows_refuse_what_is_not_n_rows_of_the_width(shape: tuple[int, ...], dtype: str) -> None:
    """A model answering another width, rank or a non-float type: an error, not wrong rows."""
    with pytest.raises(ValueError, match=r"expected"):
        rows(np.zeros(shape, dtype), "softmax", 4)


def test_model_input_refuses_anything_but_uint8_rgb_images() -> None:
    for bad in (np.zeros((1, 4, 4, 3), np.float32), np.zeros((1, 4, 4, 4), np.uint8), np.zeros((4, 4, 3), np.uint8)):
        with pytest.raises(ValueError, match=r"uint8 \[N, H, W, 3\]"):
            model_input(bad, Arithmetic())


def test_a_softmax_of_extreme_logits_stays_finite() -> None:
    """Logits of +-1e30 (a model's overflow) give probabilities, not nan."""
    got = rows(np.array([[1e30, -1e30, 0.0]], np.float32), "logits", 3)
    np.testing.assert_array_equal(got, [[1.0, 0.0, 0.0]])
    assert np.isfinite(rows(np.array([[1e30, -1e30]], np.float32), "sigmoid", 2)).all()
