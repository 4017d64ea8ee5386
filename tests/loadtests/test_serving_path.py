"""The serving-path benchmark runs end to end: both reference apps and the gateway under wrk, one table."""

from __future__ import annotations

import re

import pytest

from loadtests.harness.reference_app import SAME_WORK
from tests.loadtests import run_figure


@pytest.mark.slow
def test_serving_path_benchmark_prints_both_servers() -> None:
    out = run_figure("serving_path", "--seconds", "1", "--repeat", "1", "--connections", "8")
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^\| ([^|]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \|.*\| (\d+) \|$", out, re.M)
    }
    assert set(rows) == {"reference (FastAPI + OpenCV)", SAME_WORK, "gateway, 1 worker"}
    for rate, ratio, same_work_ratio, errors in rows.values():
        assert int(rate.replace(",", "")) > 0
        assert float(ratio) > 0
        assert float(same_work_ratio) > 0
        assert errors == "0"  # every answer was a 200: the gateway really classified, the references decoded
    assert rows["reference (FastAPI + OpenCV)"][1] == "1.00"
    assert rows[SAME_WORK][2] == "1.00"
