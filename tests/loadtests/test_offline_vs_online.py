"""The offline-vs-online benchmark runs end to end (gateway, worker, ingest client, RabbitMQ) and
gives its CPUs back."""

from __future__ import annotations

import os
import re
import subprocess

import psutil
import pytest

from loadtests.harness.deployment import broker_pid, pinning
from tests.loadtests import run_figure

pytestmark = pytest.mark.rabbitmq


def _bench_queues() -> set[str]:
    listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name"], capture_output=True, text=True, check=True)
    return {name.strip() for name in listed.stdout.splitlines() if name.strip().startswith("bench-")}


def _broker_cpus() -> set[frozenset[int]]:
    """The CPU sets RabbitMQ's threads may run on (none: no broker on this host)."""
    broker = broker_pid()
    if broker is None:
        return set()
    return {frozenset(os.sched_getaffinity(t.id)) for t in psutil.Process(broker).threads()}


@pytest.mark.slow
def test_offline_vs_online_prints_three_rows_and_restores_the_cpus() -> None:
    everything = os.sched_getaffinity(0)
    queues_before = _bench_queues()
    pin = ["--serving-cpus", "1"] if len(everything) > 1 else []
    out = run_figure(
        "offline_vs_online", "--images", "24", "--repeat", "1", "--model", "trivial", "--concurrency", "4", *pin
    )
    rows = {
        m.group(1): (float(m.group(2)), m.group(3))
        for m in re.finditer(r"^\| ([^|]+) \| ([\d.]+) \| ([\d.]+) \|", out, re.M)
    }
    assert set(rows) == {
        "this checkout: online, 4 HTTP clients",
        "this checkout: offline, ingest -> RabbitMQ -> worker",
        "this checkout: offline, worker draining a full queue",
    }
    assert all(rate > 0 for rate, _ in rows.values())  # every image got its result (the run asserts it)
    assert rows["this checkout: online, 4 HTTP clients"][1] == "1.00"
    if pin:
        assert f"pinned to CPU {max(everything)}" in out
    assert _bench_queues() == queues_before  # every queue the run declared is gone
    assert _broker_cpus() <= {frozenset(everything)}  # RabbitMQ back on every CPU


def test_pinning_gives_this_process_and_the_broker_every_cpu_back() -> None:
    """What ``--serving-cpus`` does to the process running the figure (here, this one) and to RabbitMQ:
    both on the other CPUs during the run, both back on every CPU after it."""
    everything = os.sched_getaffinity(0)
    if len(everything) < 2:
        pytest.skip("one CPU: nothing to pin apart")
    with pinning(1) as serving:
        assert serving == {max(everything)}
        assert os.sched_getaffinity(0) == everything - serving
        assert _broker_cpus() <= {frozenset(everything - serving)}
    assert os.sched_getaffinity(0) == everything
    assert _broker_cpus() <= {frozenset(everything)}
