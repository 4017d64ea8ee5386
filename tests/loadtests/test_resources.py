from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loadtests.harness.resources import ResourceSampler, children

BUSY = "x = bytearray(64 * 2**20)\nprint('ready', flush=True)\nwhile True: pass"
PARENT = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {BUSY!r}])\ntime.sleep(60)"


def started(code: str, *, wait_ready: bool = False) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if wait_ready:
        assert proc.stdout.readline().strip() == "ready"  # allocated before sampling starts
    return proc


# serial: each asserts that a busy process used over 40 % of a core, which the other tests' load
# on the cores can deny it
pytestmark = pytest.mark.serial


def test_sampler_sees_a_busy_process_and_its_memory() -> None:
    busy = started(BUSY, wait_ready=True)
    idle = started("import time; time.sleep(30)")
    try:
        with ResourceSampler({"busy": busy.pid, "idle": idle.pid}, interval=0.1) as sampler:
            time.sleep(1.5)
        report = sampler.report()
    finally:
        busy.kill()
        idle.kill()
    assert report["busy cpu %"]["mean"] > 40
    assert report["idle cpu %"]["mean"] < 10
    assert report["busy rss MiB"]["min"] >= 64
    assert report["busy cpu %"]["max"] >= report["busy cpu %"]["mean"] >= report["busy cpu %"]["min"]
    assert "gpu %" not in report  # no GPU visible here


def test_children_count_only_where_asked_and_processes_can_join_late() -> None:
    """Triton's model runs in a child process (the Python backend stub); a client can start late."""
    parent = started(PARENT)
    late = started(BUSY, wait_ready=True)
    try:
        time.sleep(0.5)  # the child is up and busy
        with ResourceSampler(
            {"tree": parent.pid, "alone": parent.pid}, interval=0.1, with_children=["tree"]
        ) as sampler:
            time.sleep(0.5)
            sampler.add("late", late.pid)
            time.sleep(1.0)
        report = sampler.report()
    finally:
        for pid in children({parent.pid}) - {parent.pid}:
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        late.kill()
    assert report["tree cpu %"]["mean"] > 40
    assert report["tree rss MiB"]["max"] >= 64
    assert report["alone cpu %"]["mean"] < 10
    assert report["late cpu %"]["mean"] > 40
