"""The serving-path benchmark runs end to end: reference app and gateway under wrk, one table."""

from __future__ import annotations

import re

import pytest

from loadtests.serving_path import main


@pytest.mark.slow
def test_serving_path_benchmark_prints_both_servers(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--seconds", "1", "--repeat", "1", "--connections", "8"])
    out = capsys.readouterr().out
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^\| ([^|]+) \| ([\d,]+) \| ([\d.]+) \|.*\| (\d+) \|$", out, re.M)
    }
    assert set(rows) == {"reference (FastAPI + OpenCV)", "gateway, 1 worker"}
    for rate, ratio, errors in rows.values():
        assert int(rate.replace(",", "")) > 0
        assert float(ratio) > 0
        assert errors == "0"  # every answer was a 200: the gateway really classified
    assert rows["reference (FastAPI + OpenCV)"][1] == "1.00"
