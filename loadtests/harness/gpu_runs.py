"""What the GPU figures (``loadtests.gpu_figures``) record and how they load a gateway: a ``Run``
(one measured configuration, with its GPU and CPU columns), the request bodies ``wrk`` posts, one
gateway run under ``wrk``, and the gateway configurations (``GatewaySpec``) a run is asked for.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from loadtests.harness.clients import _batch_totals, _mean_batch, session
from loadtests.harness.resources import ResourceSampler
from loadtests.harness.wrk import POST_BODIES, parse

BOUNDARY = "gpufiguresboundary7d1f"


@dataclass
class Run:
    section: str
    """``backend``, ``decode``, ``gateway`` (closed loop) or ``poisson`` (open loop, and the generator's ceiling)."""
    name: str
    batch: int | None = None
    in_flight: int | None = None
    images: int = 0
    seconds: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0
    gpu_util_mean: float | None = None
    gpu_util_max: float | None = None
    gpu_util_min: float | None = None
    gpu_mem_max_gib: float | None = None
    server_cpu_cores: float | None = None
    """Mean cores the measured process (tree) used."""
    client_cpu_cores: float | None = None
    mean_batch: float | None = None
    """Images per backend call in the gateway (from its /metrics)."""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    @property
    def server_cpu_ms_per_image(self) -> float | None:
        if self.server_cpu_cores is None or not self.images:
            return None
        return 1000 * self.server_cpu_cores * self.seconds / self.images


_COMPUTED = ("images_per_s", "server_cpu_ms_per_image")


def write_runs(path: Path, runs: list[Run]) -> None:
    """Every run as a CSV row: its fields (``config`` as JSON) and the figures computed from them."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, [*(f.name for f in fields(Run)), *_COMPUTED])
        writer.writeheader()
        for run in runs:
            row: dict[str, Any] = {**asdict(run), "config": json.dumps(run.config)}
            row.update((name, getattr(run, name)) for name in _COMPUTED)
            writer.writerow(row)


def read_runs(path: Path) -> list[Run]:
    """The runs ``write_runs`` wrote (a report can be written again from them)."""
    types = {f.name: f.type for f in fields(Run)}
    runs = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values: dict[str, Any] = {}
            for name, text in row.items():
                if name not in types:
                    continue  # computed
                kind = str(types[name])
                if name == "config":
                    values[name] = json.loads(text)
                elif kind.startswith("str"):
                    values[name] = text
                elif text == "":
                    values[name] = None
                else:
                    values[name] = int(text) if kind.startswith("int") else float(text)
            runs.append(Run(**values))
    return runs


@contextmanager
def sampled(run: Run, processes: dict[str, int], with_children: tuple[str, ...] = ()) -> Iterator[None]:
    """Fill ``run``'s GPU and CPU columns from a sampler running while the block does."""
    with ResourceSampler(processes, 0.1, with_children=with_children) as sampler:
        yield
    util = sampler.gpu_utilization.summary()
    if sampler.gpu_utilization.values:
        run.gpu_util_mean, run.gpu_util_max, run.gpu_util_min = util["mean"], util["max"], util["min"]
        run.gpu_mem_max_gib = max(sampler.gpu_memory.values) / 2**30
    cpu = {name: series.summary()["mean"] / 100 for name, series in sampler.cpu.items() if series.values}
    run.server_cpu_cores = cpu.get("server")
    run.client_cpu_cores = cpu.get("client")


def show(run: Run) -> None:
    """One line of progress for a finished run."""
    gpu = f" gpu {run.gpu_util_mean:.0f}%" if run.gpu_util_mean is not None else ""
    print(f"  {run.section:8s} {run.name:55s} {run.images_per_s:10.0f} img/s{gpu}", flush=True)


def bodies(photos: list[bytes], per_request: int, folder: Path, count: int = 16) -> tuple[list[Path], str]:
    """Request bodies on disk for wrk: raw JPEGs (one image per request) or multipart forms."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in range(count):
        chosen = [photos[(r * per_request + j) % len(photos)] for j in range(per_request)]
        if per_request == 1:
            data = chosen[0]
        else:
            parts = [
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{j}.jpg"\r\n'
                f"Content-Type: image/jpeg\r\n\r\n".encode()
                + photo
                + b"\r\n"
                for j, photo in enumerate(chosen)
            ]
            data = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
        path = folder / f"body-{per_request}-{r}.bin"
        path.write_bytes(data)
        paths.append(path)
    ctype = "image/jpeg" if per_request == 1 else f"multipart/form-data; boundary={BOUNDARY}"
    return paths, ctype


def gateway_run(
    url: str,
    pid: int,
    name: str,
    photos: list[bytes],
    per_request: int,
    connections: int,
    seconds: float,
    wrk: str,
    workdir: Path,
    config: dict[str, Any],
) -> Run:
    """``wrk`` with ``connections`` connections for ``seconds`` against the gateway at ``url`` (process
    ``pid``), each request ``per_request`` of ``photos``: every image answered is counted once, the
    refused requests' images as errors; with the gateway's mean batch and the CPU of both sides."""
    run = Run("gateway", name, batch=per_request, in_flight=connections, config=dict(config))
    paths, ctype = bodies(photos, per_request, workdir / "bodies")
    script = workdir / "post.lua"
    script.write_text(POST_BODIES)
    threads = max(1, min(connections, int(config.get("client_threads", 4))))
    env = {**os.environ, "GW_BODIES": ",".join(str(p) for p in paths), "GW_CTYPE": ctype}
    cmd = [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{seconds:.0f}s", "--timeout", "30s"]
    cmd += ["--latency", "-s", str(script), url]
    subprocess.run([*cmd[:6], "-d", "2s", *cmd[8:]], env=env, capture_output=True, check=False)  # warm-up
    before, engine_before = asyncio.run(_batches(url))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with sampled(run, {"server": pid, "client": proc.pid}, with_children=("server",)):
        result = parse(proc.communicate()[0])
        run.seconds = result.seconds
        run.images = (result.requests - result.failed) * per_request
    after, engine_after = asyncio.run(_batches(url))
    run.mean_batch = _mean_batch(before, after)
    engine_mean = _mean_batch(engine_before, engine_after)
    if engine_mean is not None:  # the GPU's batches are the engine's; the workers' go in config
        run.config["worker_mean_batch"], run.mean_batch = run.mean_batch, engine_mean
    run.p50_ms, run.p99_ms = result.latency_ms.get(50), result.latency_ms.get(99)
    run.errors = result.failed * per_request
    if result.refused:
        run.config["refused"] = result.refused
        print(f"refused: {result.refused}; e.g. {result.refused_sample}", file=sys.stderr)
    run.config["client"] = f"wrk -t{threads} -c{connections}"
    show(run)
    return run


async def _batches(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The workers' and the shared engine's batch-size totals."""
    async with session(url, 1) as client:
        return await _batch_totals(client), await _batch_totals(client, "gateway_engine_batch_size")


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway configuration to run: ``WORKERS[:OPTION...]``, the options ``opencv``/``nvjpeg``/
    ``nvimagecodec`` (decoder), ``graphs``/``eager``/``compiled`` (CUDA graphs, none, or
    ``torch.compile`` under CUDA graphs), ``blocking``/``spin`` (how backend
    threads wait for the GPU), ``per-worker``/``shared`` (a model in every worker, or one engine
    process) and ``fixed``/``adaptive`` (``GATEWAY_BATCH_POLICY``), e.g. ``14``, ``4:nvjpeg``,
    ``14:eager``, ``8:spin``, ``16:shared:compiled:adaptive``. The default (OpenCV, graphs, blocking,
    a model per worker, fixed) gets every load; the others the loads that tell them apart."""

    workers: int
    decoder: str = "opencv"
    mode: str = "graphs"
    sync: str = "blocking"
    engine: str = "per-worker"
    policy: str = "fixed"
    decode_threads: int = 0
    """Decode threads per worker (``tN``; 0: two per worker or more, to twice the cores in all)."""

    @classmethod
    def parse(cls, text: str) -> GatewaySpec:
        workers, *options = text.split(":")
        chosen: dict[str, Any] = {}
        for option in options:
            if option[:1] == "t" and option[1:].isdigit() and int(option[1:]) > 0 and "decode_threads" not in chosen:
                chosen["decode_threads"] = int(option[1:])
                continue
            name = _SPEC_OPTIONS.get(option)
            if name is None or name in chosen:
                choices = "".join(f"[:{c}]" for c in (*_SPEC_CHOICES, "tTHREADS"))
                raise ValueError(f"not a gateway spec: {text!r} (WORKERS{choices})")
            chosen[name] = option
        spec = cls(int(workers), **chosen)
        if spec.workers < 1:
            raise ValueError(f"not a gateway spec: {text!r}")
        return spec

    @property
    def full_plan(self) -> bool:
        return self == GatewaySpec(self.workers)

    @property
    def label(self) -> str:
        """What differs from the default, for run names."""
        names = {
            "decoder": "{} decode",
            "mode": "{}",
            "sync": "{} wait",
            "engine": "{} engine",
            "policy": "{} batching",
            "decode_threads": "{} decode threads",
        }
        default = GatewaySpec(self.workers)
        return "".join(
            f", {form.format(getattr(self, field))}"
            for field, form in names.items()
            if getattr(self, field) != getattr(default, field)
        )


_SPEC_CHOICES = (
    "opencv|nvjpeg|nvimagecodec",
    "graphs|eager|compiled",
    "blocking|spin",
    "per-worker|shared",
    "fixed|adaptive",
)
_SPEC_OPTIONS = {
    option: field
    for field, choices in zip(("decoder", "mode", "sync", "engine", "policy"), _SPEC_CHOICES, strict=True)
    for option in choices.split("|")
}
"""Each option of a gateway spec to the field it sets."""
