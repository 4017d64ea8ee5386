"""NVIDIA's perf_analyzer (built by ``scripts/perf-analyzer``) run against a Triton server: the
client that sends ready tensors, PAPER.md's reference for what the server can do."""

from __future__ import annotations

import csv
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PA_DIR = Path(os.environ.get("PERF_ANALYZER_DIR", ".perf-analyzer")).absolute()


@dataclass
class Point:
    client: str
    concurrency: int
    rate: float
    p50_ms: float
    p99_ms: float


def perf_analyzer(
    url: str,
    model: str,
    batch: int,
    concurrency: int,
    interval_ms: int,
    shm: bool,
    on_start: Callable[[int], None] | None = None,
) -> Point:
    """One perf_analyzer measurement; on a noisy host a first failure to stabilise within 50 % is
    retried once, accepting 100 %. ``on_start`` gets the perf_analyzer process id (for sampling)."""
    failure = ""
    for stability in (50, 100):
        with tempfile.NamedTemporaryFile(suffix=".csv") as out:
            cmd = [
                str(PA_DIR / "perf_analyzer"),
                *("-m", model, "-u", url, "-i", "grpc", "-b", str(batch)),
                *("--concurrency-range", str(concurrency), "--measurement-interval", str(interval_ms)),
                *("--stability-percentage", str(stability), "--max-trials", "10", "-f", out.name),
            ]
            if shm:
                cmd += ["--shared-memory", "system", "--output-shared-memory-size", str(batch * 1000 * 4)]
            env = {**os.environ, "LD_LIBRARY_PATH": str(PA_DIR / "lib")}
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if on_start is not None:
                on_start(proc.pid)
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                failure = f"perf_analyzer failed:\n{stdout[-2000:]}\n{stderr[-2000:]}"
                continue
            with open(out.name) as f:
                row = next(csv.DictReader(f))
        return Point(
            "perf_analyzer grpc" + (" shm" if shm else ""),
            concurrency,
            float(row["Inferences/Second"]),
            float(row["p50 latency"]) / 1000,
            float(row["p99 latency"]) / 1000,
        )
    raise RuntimeError(failure)
