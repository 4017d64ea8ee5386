"""The offline-vs-online benchmark runs end to end (gateway, worker, ingest client, RabbitMQ) and
gives its CPUs back."""

from __future__ import annotations

import os
import re
import subprocess

import psutil
import pytest

from loadtests.harness.deployment import broker_pid
from loadtests.offline_vs_online import main


def _bench_queues() -> set[str]:
    listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name"], capture_output=True, text=True, check=True)
    return {name.strip() for name in listed.stdout.splitlines() if name.strip().startswith("bench-")}


@pytest.mark.slow
def test_offline_vs_online_prints_three_rows_and_restores_the_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    everything = os.sched_getaffinity(0)
    queues_before = _bench_queues()
    pin = ["--serving-cpus", "1"] if len(everything) > 1 else []
    main(["--images", "24", "--repeat", "1", "--model", "trivial", "--concurrency", "4", *pin])
    out = capsys.readouterr().out
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
    assert os.sched_getaffinity(0) == everything  # this process back on every CPU
    broker = broker_pid()
    if broker is not None:
        assert all(os.sched_getaffinity(t.id) == everything for t in psutil.Process(broker).threads())
