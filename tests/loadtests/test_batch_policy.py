"""The fixed-vs-adaptive benchmark runs end to end on a real gateway and prints both policies."""

from __future__ import annotations

import re

import pytest

from tests.loadtests import run_figure


@pytest.mark.slow
def test_both_policies_are_measured_under_open_loop_load() -> None:
    out = run_figure(
        "batch_policy",
        *("--model", "trivial", "--loads", "0.5", "--seconds", "1.5", "--warmup", "0.5"),
        *("--capacity", "60", "--p99-target-ms", "5000"),
    )
    rows = re.findall(r"^\| 0.5x \| 30 \| (fixed|adaptive) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    assert [policy for policy, *_ in rows] == ["fixed", "adaptive"], out
    for _, answered, p50, p99 in rows:
        assert int(answered.replace(",", "")) > 10  # ~30/s offered, all answered
        assert 0 < float(p50) <= float(p99)
    at_target = re.findall(r"^\| (fixed|adaptive) \| ([\d,]+) \| 0.5x \| ([\d.]+) \|$", out, re.M)
    assert [policy for policy, *_ in at_target] == ["fixed", "adaptive"], out
