"""The webhook delivery benchmark runs against the real RabbitMQ, on both paths, and prints its figures."""

from __future__ import annotations

import re

import pytest

from tests.loadtests import run_figure


@pytest.mark.parametrize("path", [[], ["--fail-first", "--delay", "0.1"]])
def test_every_delivery_is_counted(path: list[str]) -> None:
    out = run_figure("webhook_delivery", "--jobs", "40", *path)
    assert out.startswith("40 webhooks")
    figures = dict(re.findall(r"^  (\w+) +([0-9.]+)$", out, re.M))
    assert set(figures) == {"deliveries_per_s", "p50_ms", "p99_ms"}
    assert float(figures["deliveries_per_s"]) > 0
    if path:  # every delivery waited for its retry
        assert float(figures["p50_ms"]) >= 100 * 0.8
