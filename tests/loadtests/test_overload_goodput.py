"""``python -m loadtests.overload_goodput`` runs as a user runs it: the gateway at capacity and at 4x
(the peers, which install their own environments, are left to the figure's own runs), and at low
load."""

from __future__ import annotations

import re

import pytest

from tests.loadtests import run_figure

pytestmark = pytest.mark.slow


def test_the_gateway_keeps_its_goodput_at_4x_and_refuses_from_the_head() -> None:
    """At 4x its capacity the gateway refuses the excess (429), fails nothing, and its own p99 of
    those refusals is within 5 ms; the figure prints its goodput ratio."""
    out = run_figure(
        "overload_goodput", "--servers", "gateway", "--modes", "closed", "--factors", "1,4", "--seconds", "3"
    )
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| gateway |")]
    assert len(rows) == 2, out
    at_4x = [cell.strip() for cell in rows[1]]
    assert at_4x[2] == "4x"
    assert float(at_4x[4]) > 0  # goodput
    assert float(at_4x[7]) > 0  # refused per second
    assert at_4x[8] == "0"  # failed
    refusal = re.fullmatch(r"<= ([0-9.]+)", at_4x[10])
    assert refusal is not None, at_4x
    assert float(refusal.group(1)) <= 5
    assert re.search(r"gateway: closed-loop goodput / its own at 1x: 1x: 1\.00, 4x: [0-9.]+", out)


def test_the_low_load_figure_prints_its_line() -> None:
    out = run_figure("overload_goodput", "--low-load", "--seconds", "2")
    assert re.search(r"low load, 8 connections, 224 px JPEG: [0-9.]+ img/s, .* mean batch [0-9.]+, 0 errors", out)
