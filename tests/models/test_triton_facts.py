"""What Triton's model metadata says, read strictly: a dimension is a whole number (HTTP's JSON) or
one written as a decimal string (gRPC's), never truncated from 3.9 or taken from True, and bounded;
an absurd width is refused by the declaration's checks; the labels' check never builds a set of the
output's width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.backends.triton_declared import MetadataError, complete_facts, triton_facts
from service.backends.triton_metadata import _labels
from service.models.declaration import DeclarationError, parse_declaration


def metadata(shape: list[Any], out: list[Any] | None = None) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": shape}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": out or [-1, 4]}],
    }


def test_whole_numbers_as_http_and_grpc_write_them() -> None:
    facts = triton_facts(metadata([-1, 3, 8, 8]))
    assert facts.inputs[0].shape == (None, 3, 8, 8)
    assert triton_facts(metadata(["-1", "3", "8", "8"])).inputs[0].shape == (None, 3, 8, 8)


@pytest.mark.parametrize("dim", [3.9, True, "3.0", " 3", None, 2**40, -2, "1e3"])
def test_a_dimension_that_is_not_a_whole_number_is_refused(dim: Any) -> None:
    with pytest.raises(MetadataError, match="tensor 'x'"):
        triton_facts(metadata([-1, dim, 8, 8]))


@pytest.mark.parametrize(("output", "width"), [("embedding", 10**9), ("sigmoid", 10**9)])
def test_an_absurd_width_is_refused(output: str, width: int) -> None:
    """An embedding of a billion numbers, or a billion labels: refused at start, not served."""
    keys: dict[str, Any] = {"output": output, "input_size": 8}
    if output == "sigmoid":
        keys["labels"] = ["a", "b"]
    d = parse_declaration(keys, "w", base=Path.cwd(), root=None)
    with pytest.raises(DeclarationError, match=f"gives {width} numbers per image"):
        complete_facts(d, triton_facts(metadata([-1, 3, 8, 8], [-1, width])), name="m", version="1", max_batch_size=4)


def test_missing_labels_are_named_without_a_set_of_the_width() -> None:
    """One label given for a width of 10**12: the first missing index is named (no set of 10**12 built)."""

    def error(problem: str) -> ValueError:
        return ValueError(problem)

    with pytest.raises(ValueError, match=r"labels for 1 of its 1000000000000 outputs \(none for output 1\)"):
        _labels([b"0.5:0:cat"], 10**12, error)
