"""The quota-cost benchmark runs: a figure for every case, admitted and refused."""

from __future__ import annotations

import re

import pytest

from loadtests import quota_cost


def test_every_case_gets_a_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """Each case prints microseconds per request (a refused case raising nothing else, an admitted
    one never refused)."""
    quota_cost.main(["--calls", "64", "--repeat", "1"])
    rows = re.findall(r"^ +([\d.]+) us  (.+)$", capsys.readouterr().out, re.M)
    assert [label for _, label in rows] == [label for label, *_ in quota_cost.CASES]
    assert all(float(us) > 0 for us, _ in rows)
