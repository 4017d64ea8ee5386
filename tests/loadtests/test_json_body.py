"""The hostile JSON body figure runs end to end against a real gateway process and prints its row."""

from __future__ import annotations

import pytest

from tests.loadtests import run_figure


@pytest.mark.slow
def test_json_body_figure_prints_the_refusal() -> None:
    out = run_figure("json_body", "--repeat", "1")
    row = next(line for line in out.splitlines() if line.startswith("| this checkout"))
    assert "| 413 payload_too_large |" in row
