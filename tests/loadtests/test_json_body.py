"""The hostile JSON body figure runs end to end against a real gateway process and prints its row."""

from __future__ import annotations

import pytest

from loadtests.json_body import main


@pytest.mark.slow
def test_json_body_figure_prints_the_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--repeat", "1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| this checkout"))
    assert "| 413 payload_too_large |" in row
