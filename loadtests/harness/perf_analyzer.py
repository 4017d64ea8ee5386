"""NVIDIA's perf_analyzer (built by ``scripts/perf-analyzer``) run against a Triton server: the
client that sends ready tensors, the study's (docs/study.md) reference for what the server can do; and against the
gateway's Open Inference Protocol fronts (gRPC and REST), with encoded photos as its BYTES input."""

from __future__ import annotations

import base64
import csv
import json
import os
import struct
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

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
    *,
    protocol: str = "grpc",
    input_data: Path | None = None,
) -> Point:
    """One perf_analyzer measurement; on a noisy host a first failure to stabilise within 50 % is
    retried once, accepting 100 %. ``on_start`` gets the perf_analyzer process id (for sampling).
    ``protocol``: ``grpc`` (``url`` host:port) or ``http`` (host:port of the REST port);
    ``input_data``: its ``--input-data`` JSON file (``bytes_input``), else random tensors.
    perf_analyzer exits non-zero when any request fails, so a Point is a run without errors."""
    failure = ""
    for stability in (50, 100):
        with tempfile.NamedTemporaryFile(suffix=".csv") as out:
            cmd = [
                str(PA_DIR / "perf_analyzer"),
                *("-m", model, "-u", url, "-i", protocol, "-b", str(batch)),
                *("--concurrency-range", str(concurrency), "--measurement-interval", str(interval_ms)),
                *("--stability-percentage", str(stability), "--max-trials", "10", "-f", out.name),
            ]
            if input_data is not None:
                cmd += ["--input-data", str(input_data)]
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
            f"perf_analyzer {protocol}" + (" shm" if shm else ""),
            concurrency,
            float(row["Inferences/Second"]),
            float(row["p50 latency"]) / 1000,
            float(row["p99 latency"]) / 1000,
        )
    raise RuntimeError(failure)


def bytes_input(name: str, elements: list[bytes], path: Path) -> Path:
    """perf_analyzer's ``--input-data`` file for a BYTES input ``name`` of one element per request
    (the gateway's ``IMAGE``, dims ``[1]``): one step per element, sent in turn. A step's ``b64``
    is the tensor's raw contents, which for BYTES perf_analyzer sends as they are, so each element
    carries the protocol's 4-byte little-endian length before its bytes (without it the server reads
    the JPEG's first bytes as a length). Its ``content`` as a JSON array would take only UTF-8 text."""
    steps = [
        {name: {"b64": base64.b64encode(struct.pack("<I", len(data)) + data).decode(), "shape": [1]}}
        for data in elements
    ]
    path.write_text(json.dumps({"data": steps}))
    return path


@dataclass(frozen=True)
class Counts:
    """What a server's statistics extension has counted for a model, all versions together."""

    succeeded: int
    failed: int
    inferences: int
    """Inputs inferred (images, here)."""
    executions: int
    """Backend executions (batches): ``inferences / executions`` is the mean batch."""

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.succeeded - other.succeeded,
            self.failed - other.failed,
            self.inferences - other.inferences,
            self.executions - other.executions,
        )


def request_counts(http_url: str, model: str) -> Counts:
    """What a server has counted for ``model`` (``GET /v2/models/{model}/stats``, the statistics
    extension): the gateway's and Triton's alike, so a run is counted by the server it loads."""
    answer = httpx.get(f"{http_url}/v2/models/{model}/stats", timeout=10)
    answer.raise_for_status()
    versions = answer.json()["model_stats"]
    return Counts(
        sum(int(v["inference_stats"]["success"]["count"]) for v in versions),
        sum(int(v["inference_stats"]["fail"]["count"]) for v in versions),
        sum(int(v.get("inference_count", 0)) for v in versions),
        sum(int(v.get("execution_count", 0)) for v in versions),
    )
