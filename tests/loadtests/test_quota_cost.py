"""The quota-cost benchmark runs: a figure for every case, admitted and refused."""

from __future__ import annotations

import re

from loadtests.harness.quota_cases import CASES
from tests.loadtests import run_figure


def test_every_case_gets_a_figure() -> None:
    """Each case prints microseconds per request (a refused case raising nothing else, an admitted
    one never refused)."""
    out = run_figure("quota_cost", "--calls", "64", "--repeat", "1")
    rows = re.findall(r"^ +([\d.]+) us  (.+)$", out, re.M)
    assert [label for _, label in rows] == [label for label, *_ in CASES]
    assert all(float(us) > 0 for us, _ in rows)
