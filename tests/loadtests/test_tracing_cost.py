"""The tracing-cost benchmarks run: the edge's per-request cost, and the serving path traced."""

from __future__ import annotations

import re

import pytest

from tests.loadtests import run_figure


def test_edge_cost_table_has_every_variant() -> None:
    out = run_figure("tracing_cost", "--ratios", "0.5,1", "--requests", "400", "--repeat", "1")
    rows = dict(re.findall(r"^\| (tracing [^|]+) \| ([\d.]+) \|", out, re.M))
    assert set(rows) == {"tracing off", "tracing 0.5", "tracing 1"}
    assert all(float(us) > 0 for us in rows.values())


@pytest.mark.slow
def test_serving_path_measures_traced_gateways_and_feeds_the_sink() -> None:
    out = run_figure("serving_path", "--seconds", "1", "--repeat", "1", "--connections", "8", "--tracing", "1")
    traced = re.search(r"^\| gateway, 1 worker, tracing 1 \| ([\d,]+) \|.*\| (\d+) \|$", out, re.M)
    assert traced is not None, out
    assert int(traced.group(1).replace(",", "")) > 0
    assert traced.group(2) == "0"
    exports = re.search(r"traces: ([\d,]+) OTLP exports", out)
    assert exports is not None, out  # every request sampled: spans reached the sink
    assert int(exports.group(1).replace(",", "")) > 0
