"""The load generator against its trivial server: every connection used, an open loop's latency
counted from the scheduled time (a stalled server shows in the percentiles, not only in the few
requests that were on the wire), the rate search, and the command's output with its ceiling."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loadtests.harness.loadgen import Load, find_rate, run, trivial_server

pytestmark = pytest.mark.slow  # the load generator runs its connections in processes of their own


def test_a_closed_loop_uses_every_connection_over_its_processes() -> None:
    with trivial_server(1) as server:
        result = run(Load(server.url, b"x" * 1000, connections=1024, processes=2, seconds=1.0))
        accepted = server.accepted.value
    assert accepted == 1024
    assert result.errors == 0
    assert result.completed > 1024  # every connection answered, and went round again


def test_an_open_loop_counts_a_stall_from_each_requests_scheduled_time() -> None:
    """500 requests/s on 8 connections; the server stalls for 0.5 s a second into the run. Every
    arrival in the stall waits (for the server, then for a connection): about a quarter of the
    requests are late, so p90 is far above the unstalled p50. Measured from the send, as a closed
    loop does, only the 8 requests on the wire would have been slow (p90 well under a millisecond
    or two here)."""
    with trivial_server(1, freeze=(1.0, 1.5)) as server:
        result = run(Load(server.url, b"x" * 1000, connections=8, processes=1, seconds=3.0, rate=500, seed=1))
    assert result.errors == 0
    assert result.waited > 100  # arrivals that found all 8 connections stuck
    assert result.percentile_ms(50) < 20
    assert result.percentile_ms(90) > 50
    assert 400 < result.percentile_ms(99.9) < 700  # at most the stall, plus the backlog after it


def test_an_open_loops_warmup_is_sent_and_not_counted() -> None:
    """The same stall inside a second of warm-up: those arrivals are sent (the server froze on
    them) and none is counted, so the measured second is the unstalled server's; its throughput is
    over the measured second alone. Without the warm-up the stall is in the figures."""
    load = Load("", b"x" * 1000, connections=8, processes=1, seconds=1.5, rate=500, seed=1, warmup=1.0)
    with trivial_server(1, freeze=(0.2, 0.7)) as server:
        warmed = run(replace(load, url=server.url))
    with trivial_server(1, freeze=(0.2, 0.7)) as server:
        cold = run(replace(load, url=server.url, warmup=0.0))
    assert warmed.errors == cold.errors == 0
    assert warmed.waited == 0
    assert warmed.percentile_ms(99) < 50
    assert 500 < warmed.completed < 1000  # 1.5 s at 500/s, not 2.5 s
    assert 400 < warmed.throughput < 600
    assert cold.waited > 50
    assert cold.percentile_ms(99) > 200


def test_the_rate_search_finds_a_rate_within_the_bound() -> None:
    with trivial_server(1) as server:
        # a loose bound: the search is tested here, not this (shared, 2-core) machine's latency
        best, runs = find_rate(Load(server.url, b"x", connections=32, seconds=0.5), 200.0, 100.0, 400.0, steps=2)
    assert best == 250.0  # 100 met the bound, then the midpoint did
    assert [r.load.rate for r in runs] == [100.0, 250.0]


def test_the_climbing_search_goes_up_by_its_factor_then_bisects() -> None:
    with trivial_server(1) as server:
        load = Load(server.url, b"x", connections=32, seconds=0.3)
        best, runs = find_rate(load, 200.0, 100.0, 1000.0, steps=3, climb=2.0, rest=0.1)
        assert [r.load.rate for r in runs] == [100.0, 200.0, 400.0]  # never past what met the bound by more than 2x
        assert best == 400.0
        # a bound nothing meets after the first: the next rate is halfway back, not further up
        best, runs = find_rate(load, 200.0, 100.0, 150.0, steps=3, climb=2.0)
        assert [r.load.rate for r in runs] == [100.0, 125.0, 137.5]


def test_the_command_prints_its_figure_and_its_ceiling(tmp_path: Path) -> None:
    """``python -m loadtests.loadgen`` as a user runs it, against the trivial server."""
    body = tmp_path / "body.bin"
    body.write_bytes(b"x" * 100)
    with trivial_server(1) as server:
        args = [server.url, "--body", str(body), "--connections", "16", "--seconds", "0.5", "--ceiling"]
        done = subprocess.run(
            [sys.executable, "-m", "loadtests.loadgen", *args], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("closed, 16 connections x 1 processes: ")
    assert lines[1].startswith("generator ceiling (trivial server): closed, 16 connections x 1 processes: ")
    assert all("0 errors" in line for line in lines)
