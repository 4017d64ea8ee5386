from __future__ import annotations

import subprocess
import sys
import time

from loadtests.resources import ResourceSampler


def test_sampler_sees_a_busy_process_and_its_memory() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 * 2**20)\nwhile True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
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
