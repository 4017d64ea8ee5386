"""The hostile body figures (``json_body``, ``chunked_body``, ``v2_envelope``, all measured by
``loadtests.harness.hostile_body``) run end to end against a real gateway process and print their rows."""

from __future__ import annotations

import pytest

from tests.loadtests import run_figure


def _row(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("| this checkout"))


@pytest.mark.slow
def test_json_body_figure_prints_the_refusal() -> None:
    assert "| 413 payload_too_large |" in _row(run_figure("json_body", "--repeat", "1"))


@pytest.mark.slow
def test_chunked_body_figure_prints_the_refusal() -> None:
    out = run_figure("chunked_body", "--repeat", "1", "--chunks", "20000", "--connections", "2")
    assert "| 413 payload_too_large |" in _row(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["binary", "json"])
def test_v2_envelope_figure_prints_the_refusal(kind: str) -> None:
    out = run_figure("v2_envelope", "--repeat", "1", "--kind", kind, "--elements", "100000")
    row = _row(out)
    assert "| 400 " in row
    assert ("goes on after 1 elements" if kind == "binary" else "JSON values") in row
