"""The GPU figures (issue 14), in one command, on a machine with an NVIDIA GPU:

    python -m loadtests.gpu_figures --photos DIR --full-photos DIR --out docs/bench/gpu [--wrk PATH]

What it measures, each in the same run:

* **backend alone**: the ``torch`` backend (ResNet-50, fp16) called in this process on decoded
  224 px tensors, at each batch size, one batch in flight ("sync") and four ("async"), with CUDA
  graphs and eager, side by side;
* **decode alone**: OpenCV on every core (the gateway's ``prepare``) against nvJPEG through
  torchvision's batched ``decode_jpeg`` on the GPU (plus the crop and resize there), on 224 px JPEGs
  and on full-size photos;
* **gateway**: ``gateway serve --backend torch`` in each ``--gateways`` configuration (workers,
  OpenCV or nvJPEG decode, CUDA graphs or eager), JPEGs in over HTTP, labels out, loaded by ``wrk``
  (C; its own CPU reported); one image per request and several per request; a sync client (one
  request at a time) and many connections;
* GPU utilisation and memory (NVML) and the CPU of gateway and client during every run; the ratio
  gateway / backend alone (the study's (docs/study.md) 410/458 = 0.895); the cost per million images at a GPU price.

It writes ``report.md``, ``runs.csv`` and ``throughput_vs_batch.png`` into ``--out``. Without a GPU
it runs on the CPU (``--device cpu``), slowly, to check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtests.harness.gpu_report import write_report
from loadtests.harness.gpu_runs import GatewaySpec, Run, gateway_run, sampled, show
from loadtests.harness.http_load import start_gateway, stop_process
from loadtests.harness.loadgen import Load, Result, ceiling, find_rate
from loadtests.harness.loadgen import run as run_load
from loadtests.harness.profile import heaviest, record
from loadtests.harness.resources import nvml
from loadtests.harness.stages import stage_line, stage_quantiles
from service.backends.torch_backend import TorchBackend
from service.images.gpu_decode import GpuDecoder
from service.images.preprocess import PreprocessConfig, prepare

BACKEND_MODES = ("graphs", "eager", "compiled", "compiled-max", "fp32")


def environment(device: str) -> dict[str, str]:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "cudnn": str(torch.backends.cudnn.version()),  # type: ignore[no-untyped-call]
        "cpu cores": str(os.cpu_count()),
        "cpu": platform.processor() or platform.machine(),
    }
    lib: Any = nvml()
    if lib is not None:
        handle = lib.nvmlDeviceGetHandleByIndex(0)
        env["gpu"] = str(lib.nvmlDeviceGetName(handle))
        env["driver"] = str(lib.nvmlSystemGetDriverVersion())
        env["gpu memory GiB"] = f"{lib.nvmlDeviceGetMemoryInfo(handle).total / 2**30:.0f}"
    else:
        env["gpu"] = f"none ({device})"
    with suppress(OSError, StopIteration):
        env["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return env


# --- backend alone -----------------------------------------------------------------------------


async def drive(backend: TorchBackend, run: Run, inputs: list[np.ndarray], seconds: float) -> None:
    """``run.in_flight`` callers, each sending ``inputs`` as one batch again and again for
    ``seconds``; fills the run's images, time, rate, latencies and resource columns."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def caller() -> int:
        done = 0
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await backend.infer(inputs)
            latencies.append(time.perf_counter() - t0)
            done += len(inputs)
        return done

    await backend.infer(inputs)
    with sampled(run, {"server": os.getpid()}):
        start = time.perf_counter()
        run.images = sum(await asyncio.gather(*(caller() for _ in range(run.in_flight or 1))))
        run.seconds = time.perf_counter() - start
    run.p50_ms, run.p99_ms = _percentiles(latencies)
    show(run)


async def backend_alone(
    tensors: list[np.ndarray], batches: list[int], in_flights: list[int], seconds: float, device: str, modes: list[str]
) -> list[Run]:
    """Every batch size with each number of batches in flight, for each mode: ``graphs`` (CUDA
    graphs, fp16, the default), ``eager`` (PyTorch launching every layer from Python), ``compiled``
    (``torch.compile``, then CUDA graphs), ``compiled-max`` (its max-autotune) and ``fp32`` (CUDA
    graphs in fp32: the reference the others' answers are compared with), side by side."""
    runs = []
    answers: dict[str, list[np.ndarray]] = {}
    for mode in modes:
        if mode not in BACKEND_MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(BACKEND_MODES)}")
        backend = TorchBackend(
            None,
            device=device,
            max_batch_size=max(batches),
            max_concurrency=max(in_flights),
            cuda_graphs=mode != "eager",
            precision="fp32" if mode == "fp32" else "fp16",
            compile={"compiled": "on", "compiled-max": "max-autotune"}.get(mode, "off"),
            bucket_sizes=[1, 8, *batches],  # the batches measured, and those the modes' answers are compared at
        )
        started = time.perf_counter()
        await backend.start()
        problem = await backend.ready()
        if problem:
            raise SystemExit(f"torch backend not ready: {problem}")
        print(f"backend: {backend.detail} (ready in {time.perf_counter() - started:.0f} s)", flush=True)
        try:
            # the same images at a padded bucket (5 of 8), a full one and batch 1, to compare the modes
            answers[mode] = [await backend.infer(tensors[: min(n, max(batches))]) for n in (5, 8, 1)]
            for batch in batches:
                inputs = [tensors[i % len(tensors)] for i in range(batch)]
                for in_flight in in_flights:
                    runs.append(Run("backend", f"torch {mode} b{batch} x{in_flight}", batch, in_flight))
                    runs[-1].config["mode"] = mode
                    await drive(backend, runs[-1], inputs, seconds)
        finally:
            await backend.aclose()
    if len(answers) > 1:
        first, *others = sorted(answers, key=lambda mode: mode != "fp32")  # against fp32 where it ran
        for other in others:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(answers[first], answers[other], strict=True))
            top1 = all(
                np.array_equal(a.argmax(1), b.argmax(1)) for a, b in zip(answers[first], answers[other], strict=True)
            )
            print(f"backend answers, {first} vs {other}: max |difference| {diff:.2e}, same top-1: {top1}", flush=True)
            runs[0].config[f"vs {other}"] = {"max_abs_difference": diff, "same_top1": top1}
    return runs


# --- decode alone ------------------------------------------------------------------------------


def cpu_decode(photos: list[bytes], label: str, seconds: float, threads: int) -> Run:
    import cv2

    cv2.setNumThreads(1)
    config = PreprocessConfig()
    run = Run("decode", f"OpenCV CPU, {label}", config={"threads": threads})
    with sampled(run, {"server": os.getpid()}), ThreadPoolExecutor(threads) as pool:
        end = time.perf_counter() + seconds

        def loop(offset: int) -> int:
            done = 0
            while time.perf_counter() < end:
                prepare(photos[(offset + done) % len(photos)], config)
                done += 1
            return done

        start = time.perf_counter()
        run.images = sum(pool.map(loop, range(threads)))
        run.seconds = time.perf_counter() - start
    show(run)
    return run


def gpu_decode(photos: list[bytes], label: str, seconds: float, batch: int) -> Run | None:
    """nvJPEG through torchvision: a batch of JPEGs decoded on the GPU, then each centre-cropped and
    resized (antialiased) there to the model's 224 x 224."""
    try:
        import torch
        from torchvision.io import decode_jpeg

        from service.images.gpu_decode import resize_chw
    except ImportError as exc:
        print(f"GPU decode skipped: {exc}", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        return None
    config = PreprocessConfig()
    datas = [torch.frombuffer(bytearray(photos[i % len(photos)]), dtype=torch.uint8) for i in range(batch)]

    def one_batch() -> None:
        decoded = decode_jpeg(datas, device="cuda")
        for img in decoded:
            resize_chw(img, config)  # what GATEWAY_DECODER=nvjpeg does
        torch.cuda.synchronize()

    one_batch()
    run = Run("decode", f"nvJPEG GPU, {label}", batch=batch)
    from service.images.gpu_decode import NvJpegDecoder

    _versus_opencv(run, "nvJPEG", label, NvJpegDecoder("cuda", lambda reason: None), photos, config)
    return _batches(run, one_batch, batch, seconds)


def _versus_opencv(
    run: Run, what: str, label: str, decoder: GpuDecoder, photos: list[bytes], config: PreprocessConfig
) -> None:
    """How many of 16 photos the GPU decoded, and its pixels' largest mean difference from OpenCV's."""
    fallbacks: list[str] = []
    decoder.on_fallback = fallbacks.append
    ours = decoder.prepare_many(photos[:16], config)
    differences = [
        float(np.abs(a.astype(np.int16) - prepare(photo, config)).mean())
        for a, photo in zip(ours, photos[:16], strict=True)
        if isinstance(a, np.ndarray)
    ]
    run.config["decoded on the GPU"] = f"{len(ours) - len(fallbacks)} of {len(ours)}"
    worst = run.config["mean_abs_pixel_difference_vs_opencv"] = max(differences) if differences else None
    print(f"  {what} vs OpenCV, {label}: mean |pixel difference| at most {worst}", flush=True)


def _batches(run: Run, one_batch: Callable[[], object], batch: int, seconds: float) -> Run:
    """``one_batch`` of ``batch`` images again and again for ``seconds``, measured into ``run``."""
    with sampled(run, {"server": os.getpid()}):
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < end:
            one_batch()
            run.images += batch
        run.seconds = time.perf_counter() - start
    show(run)
    return run


def nvimagecodec_decode(
    photos: list[bytes], label: str, seconds: float, batch: int, backends: tuple[str, ...] | None = None
) -> Run | None:
    """nvImageCodec (``GATEWAY_DECODER=nvimagecodec``: the hardware JPEG decoder first) as the
    gateway runs it: a batch decoded, each cropped, resized and oriented on the GPU, copied back.
    ``backends``: only these of its decoders (``("HW_GPU_ONLY",)``: its images decoded on the GPU
    say whether the hardware decoder took them; the others fall back to OpenCV)."""
    try:
        from service.images.gpu_decode import NVIMAGECODEC_BACKENDS, NvImageCodecDecoder

        decoder = NvImageCodecDecoder("cuda", lambda reason: None, backends=backends or NVIMAGECODEC_BACKENDS)
    except (ImportError, RuntimeError) as exc:
        print(f"nvImageCodec decode skipped: {exc}", file=sys.stderr)
        return None
    config = PreprocessConfig()
    datas = [photos[i % len(photos)] for i in range(batch)]
    only = f", {' + '.join(backends)} only" if backends else ""
    run = Run("decode", f"nvImageCodec GPU, {label}{only}", batch=batch)
    _versus_opencv(run, "nvImageCodec", label, decoder, photos, config)
    decoder.prepare_many(datas, config)  # warm
    return _batches(run, partial(decoder.prepare_many, datas, config), batch, seconds)


# --- gateway over HTTP -------------------------------------------------------------------------


def _metrics_text(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return f"# /metrics: {exc}"


def _gpu_settled(processes: int, timeout: float, steady: int = 3) -> int:
    """Wait until ``processes`` processes hold the GPU and its used memory has not moved for
    ``steady`` seconds: /readyz answers from the first worker that is ready, and the others are
    still warming up (each captures its CUDA graphs) then. Returns the processes seen."""
    lib: Any = nvml()
    if lib is None:
        return 0
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    deadline, last, same, seen = time.monotonic() + timeout, -1, 0, 0
    while time.monotonic() < deadline:
        seen = len(lib.nvmlDeviceGetComputeRunningProcesses(handle))
        used = lib.nvmlDeviceGetMemoryInfo(handle).used
        same = same + 1 if used == last and seen >= processes else 0
        if same >= steady:
            break
        last = used
        time.sleep(1)
    return seen


def gateway_runs(
    spec: GatewaySpec,
    photos: list[bytes],
    full: list[bytes],
    seconds: float,
    wrk: str,
    workdir: Path,
    device: str,
    max_batch: int,
    quick: bool,
    loads: list[tuple[int, int]] | None = None,
    poisson: Poisson | None = None,
    profile: tuple[float, Path] | None = None,
) -> list[Run]:
    """``loads`` (images per request, connections) replaces the spec's plan with those loads on 224 px
    photos (e.g. a sweep over worker counts). ``poisson``: then the highest open-loop rate of one
    image per request within its p99 bound (``loadtests.harness.loadgen``), its ceiling beside it.
    Every run gets the gateway's stage timings (``gateway_stage_seconds``) over it; ``profile``
    (seconds, folder): its first run's engine and one worker are sampled by py-spy that long."""
    cores = os.cpu_count() or 2
    workers, decoder = spec.workers, spec.decoder
    most = max([c for _, c in loads or []] + [128, poisson.connections if poisson else 0])
    in_flight = max(64, -(-2 * most // workers))  # every connection's request admitted, however they spread
    settings = {
        "GATEWAY_BACKEND": "torch",
        "GATEWAY_MODEL": "resnet50",
        "GATEWAY_TORCH_DEVICE": device,
        "GATEWAY_WORKERS": str(workers),
        "GATEWAY_MAX_BATCH_SIZE": str(max_batch),
        "GATEWAY_MAX_QUEUE_SIZE": "4096",
        "GATEWAY_REQUEST_TIMEOUT": "30",
        "GATEWAY_PREPROCESS_WORKERS": str(spec.decode_threads or max(2, 2 * cores // workers)),
        "GATEWAY_MAX_IMAGES_PER_REQUEST": "64",
        "GATEWAY_MAX_CONCURRENT_REQUESTS": str(in_flight),
        "GATEWAY_DECODER": decoder,
        "GATEWAY_TORCH_CUDA_GRAPHS": str(spec.mode != "eager").lower(),
        "GATEWAY_TORCH_COMPILE": "on" if spec.mode == "compiled" else "off",
        "GATEWAY_TORCH_SYNC": spec.sync,
        "GATEWAY_TORCH_ENGINE": spec.engine,
        "GATEWAY_BATCH_POLICY": spec.policy,
    }
    started = time.perf_counter()
    proc, url = start_gateway([], workdir / "models", timeout=600, env=settings)
    settled = _gpu_settled(1 if spec.engine == "shared" else workers, timeout=300)
    print(
        f"gateway with {workers} workers ready in {time.perf_counter() - started:.0f} s"
        f" ({settled} processes on the GPU, memory steady)",
        flush=True,
    )
    config = {
        "workers": workers,
        "max_batch_size": max_batch,
        "client_threads": max(1, cores // 4),
        "decoder": decoder,
        "mode": spec.mode,
        "sync": spec.sync,
        "engine": spec.engine,
        "policy": spec.policy,
        "decode_threads": settings["GATEWAY_PREPROCESS_WORKERS"],
    }
    runs = []
    try:
        # connections: at most 64 in all, the default requests in flight per worker, so none is refused
        plan = [
            ("224 px", photos, 1, 64),
            ("224 px", photos, 16, 64),
            ("224 px", photos, 32, 32),
            ("224 px", photos, 64, 1),
        ]
        if not spec.full_plan:  # what tells the variants apart: small batches and the CPU-bound cases
            plan = [("224 px", photos, 1, 64), ("224 px", photos, 32, 32)]
        if not quick and (spec.full_plan or decoder != "opencv"):
            plan += [("full-size", full, 1, 128)]
        if loads:
            plan = [("224 px", photos, per_request, connections) for per_request, connections in loads]
        for i, (label, images, per_request, connections) in enumerate(plan):
            name = f"{workers} workers, {label}, {per_request}/request, {connections} conn"
            name += spec.label
            before = _metrics_text(url)
            sampling = _profiles(proc.pid, profile, spec) if profile is not None and i == 0 else []
            runs.append(
                gateway_run(url, proc.pid, name, images, per_request, connections, seconds, wrk, workdir, config)
            )
            _staged(runs[-1], before, _metrics_text(url))
            _profiled(sampling)
        if poisson is not None:
            runs += poisson_runs(url, spec, photos, poisson, config)
        gpu_series = [line for line in _metrics_text(url).splitlines() if line.startswith("gateway_gpu_")]
        print("  the gateway's own GPU series at the end:", *gpu_series, sep="\n    ", flush=True)
    finally:
        stop_process(proc, 30)
    return runs


def _staged(run: Run, before: str, after: str) -> None:
    """The gateway's stage timings between two /metrics readings, into the run and the log."""
    run.config["stages"] = table = stage_quantiles(before, after)
    if table:
        print(f"    stages p50/p99 ms: {stage_line(table)}", flush=True)


def _profiles(pid: int, profile: tuple[float, Path], spec: GatewaySpec) -> list[tuple[str, Path, Any]]:
    """py-spy on the engine (shared) and one worker, from 3 s on (after the run's warm-up), for the
    profile's seconds; (what, file, process) of each begun."""
    import psutil

    seconds, folder = profile
    folder.mkdir(parents=True, exist_ok=True)
    children = psutil.Process(pid).children(recursive=True)
    engines = [c for c in children if "--ready-fd" in " ".join(c.cmdline())]
    workers = [c for c in children if c not in engines and c.name().startswith("python")]
    chosen = [("engine", engines[0].pid)] if engines else []
    chosen += [("worker", workers[-1].pid)] if workers else []
    begun = []
    for what, child in chosen:
        out = folder / f"profile-{what}{spec.label.replace(', ', '-').replace(' ', '-')}.txt"
        process = record(child, seconds, out, delay=3)  # past the run's 2 s warm-up
        if process is None:
            print("  py-spy not installed: no profile", flush=True)
            return []
        begun.append((what, out, process))
    return begun


def _profiled(sampling: list[tuple[str, Path, Any]]) -> None:
    """Wait for the profiles and print each one's heaviest functions."""
    for what, out, process in sampling:
        _, error = process.communicate(timeout=120)
        if process.returncode != 0 or not out.exists():
            print(f"  py-spy on the {what} failed: {error.decode(errors='replace')[-400:]}", flush=True)
            continue
        total, ranked = heaviest(out)
        print(f"  where the {what}'s CPU went ({total} samples; self %, inclusive %):", flush=True)
        for name, own, within in ranked:
            print(f"    {own:5.1f} {within:5.1f}  {name}", flush=True)


@dataclass(frozen=True)
class Poisson:
    """The open-loop search: its p99 bound, the rates searched, the generator's shape."""

    p99_ms: float
    low: float
    high: float
    connections: int = 1024
    processes: int = 4
    steps: int = 9
    climb: float = 1.25
    """Up from ``low`` by this factor until a rate misses the bound, then bisection (``find_rate``)."""
    rest: float = 3.0
    """Seconds between the steps, for the gateway to drain."""
    seconds: float = 5.0
    warmup: float = 1.0
    """Seconds of arrivals before each run's measurement (sent, not counted)."""


def poisson_runs(
    url: str, spec: GatewaySpec, photos: list[bytes], poisson: Poisson, config: dict[str, Any]
) -> list[Run]:
    """Search (up, then by bisection) for the highest Poisson rate of one 224 px photo per request whose p99 (from each
    request's scheduled time) stays within the bound with no error; each step a run of the report,
    and the generator's ceiling with the same shape (a trivial server) as the last."""
    load = Load(
        f"{url}/classify",
        photos[0],
        connections=poisson.connections,
        processes=poisson.processes,
        seconds=poisson.seconds,
        warmup=poisson.warmup,
    )
    stages: dict[float, dict[str, dict[str, float]]] = {}

    def measure(load: Load) -> Result:  # each step with the gateway's stage timings over it
        before = _metrics_text(url)
        result = run_load(load)
        stages[load.rate or 0.0] = table = stage_quantiles(before, _metrics_text(url))
        print(f"  Poisson {load.rate or 0:,.0f}/s: p99 {result.percentile_ms(99):.1f} ms", flush=True)
        print(f"    stages p50/p99 ms: {stage_line(table)}", flush=True)
        return result

    best, results = find_rate(
        load, poisson.p99_ms, poisson.low, poisson.high, poisson.steps, measure, climb=poisson.climb, rest=poisson.rest
    )
    limit = ceiling(load)
    runs = []
    for result in [*results, limit]:
        is_ceiling = result is limit
        what = "generator ceiling (trivial server, closed)" if is_ceiling else f"Poisson {result.load.rate:,.0f}/s"
        gateway = f"{spec.workers} workers{spec.label}"
        run = Run("poisson", f"{spec.workers} workers, 224 px, 1/request, {what}{spec.label}", 1, poisson.connections)
        run.images, run.seconds, run.errors = result.completed, result.elapsed, result.errors
        run.p50_ms, run.p99_ms = result.percentile_ms(50), result.percentile_ms(99)
        run.config = {
            **config,
            "gateway": gateway,
            "ceiling": is_ceiling,
            "offered_rate": result.load.rate,
            "sender_lag_p99_ms": result.sender_lag_p99_ms,
            "p90_ms": result.percentile_ms(90),
            "p99_9_ms": result.percentile_ms(99.9),
            "warmup_s": poisson.warmup,
            "waited_for_a_connection": result.waited,
            "highest_rate_within_p99": best,
            "p99_bound_ms": poisson.p99_ms,
        }
        if not is_ceiling and (result.load.rate or 0.0) in stages:
            run.config["stages"] = stages[result.load.rate or 0.0]
        show(run)
        runs.append(run)
    print(f"  highest Poisson rate with p99 <= {poisson.p99_ms:g} ms: {best:,.0f} images/s", flush=True)
    return runs


# --- report ------------------------------------------------------------------------------------


def _percentiles(latencies: list[float]) -> tuple[float | None, float | None]:
    if not latencies:
        return None, None
    return float(np.percentile(latencies, 50)) * 1000, float(np.percentile(latencies, 99)) * 1000


def _read(folder: Path) -> list[bytes]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg"})
    if not files:
        raise SystemExit(f"no JPEGs in {folder}")
    return [p.read_bytes() for p in files]


def _timed(what: str, step: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    print(f"{what}...", flush=True)
    result = step()
    print(f"{what}: {time.perf_counter() - started:.0f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=Path, required=True, help="224 px JPEGs (python -m loadtests.harness.dataset)")
    parser.add_argument("--full-photos", type=Path, required=True, help="full-size JPEG photos")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--wrk", default=shutil.which("wrk"), help="wrk binary (default: the one on PATH)")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--in-flight", default="1,4")
    parser.add_argument(
        "--gateways",
        default="8,14,14:opencv:eager,4:nvjpeg,14:nvjpeg",
        help="gateway configurations, comma-separated: "
        "WORKERS[:opencv|nvjpeg][:graphs|eager][:blocking|spin][:per-worker|shared]",
    )
    parser.add_argument(
        "--loads",
        default="",
        help="PER_REQUEST:CONNECTIONS,... on 224 px photos for every gateway instead of its plan (e.g. 1:64,32:32)",
    )
    parser.add_argument(
        "--modes",
        default="graphs,eager",
        help=f"backend-alone modes, of {', '.join(BACKEND_MODES)} (fp32: the reference)",
    )
    parser.add_argument("--max-batch", type=int, default=128, help="the gateway's GATEWAY_MAX_BATCH_SIZE")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--gpu-hour-usd", type=float, default=3.0, help="assumed price of one GPU-hour")
    parser.add_argument("--skip", default="", help="sections to skip: backend,decode,gateway")
    parser.add_argument(
        "--poisson",
        metavar="P99_MS:LOW:HIGH",
        help="after each gateway's runs, the highest Poisson rate (one image per request, 1,024 connections from "
        "4 processes) whose p99 stays within P99_MS, searched in [LOW, HIGH), e.g. 15:2000:40000",
    )
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="py-spy on the shared engine and one worker during each gateway's first run (py-spy installed)",
    )
    parser.add_argument("--quick", action="store_true", help="short runs (to check the script)")
    args = parser.parse_args()
    if args.wrk is None and "gateway" not in args.skip:
        parser.error("the gateway runs need wrk (apt-get install wrk, or --wrk PATH; scripts/gpu-bundle carries it)")
    started = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    photos, full = _read(args.photos), _read(args.full_photos)
    env = environment(args.device)
    print(json.dumps(env), flush=True)
    config = PreprocessConfig()
    tensors = [prepare(p, config) for p in photos[:64]]
    runs: list[Run] = []
    seconds = 1.0 if args.quick else args.seconds
    gateways = [GatewaySpec.parse(text) for text in args.gateways.split(",") if text]
    loads = [(int(a), int(b)) for a, b in (text.split(":") for text in args.loads.split(",") if text)]
    poisson = None
    if args.poisson:
        bound, low, high = (float(part) for part in args.poisson.split(":"))
        poisson = Poisson(bound, low, high, seconds=min(seconds, 5.0))

    def report() -> None:  # after every section: a run cut off at its time limit keeps what it measured
        if runs:
            command = f"python -m loadtests.gpu_figures {' '.join(sys.argv[1:])}"
            write_report(args.out, env, runs, command, time.perf_counter() - started, args.gpu_hour_usd)

    if "backend" not in skip:
        batches = [int(b) for b in args.batches.split(",")]
        in_flights = [int(n) for n in args.in_flight.split(",")]
        modes = [m for m in args.modes.split(",") if m]
        try:
            runs += _timed(
                "backend alone",
                lambda: asyncio.run(backend_alone(tensors, batches, in_flights, seconds / 2, args.device, modes)),
            )
        except (Exception, SystemExit):  # the other sections still run
            traceback.print_exc()
        report()
    if "decode" not in skip:
        cores = os.cpu_count() or 2
        for label, images in (("224 px", photos), ("full-size", full)):
            runs.append(cpu_decode(images, label, seconds / 2, cores))
            hardware_only = partial(nvimagecodec_decode, backends=("HW_GPU_ONLY",))
            for decode in (gpu_decode, nvimagecodec_decode, hardware_only):
                gpu = decode(images, label, seconds / 2, 64 if label == "224 px" else 16)
                if gpu is not None:
                    runs.append(gpu)
        report()
    if "gateway" not in skip:
        with tempfile.TemporaryDirectory(prefix="gpu-figures-") as tmp:
            for spec in gateways:
                print(f"gateway, {spec}...", flush=True)
                try:
                    runs += gateway_runs(
                        spec,
                        photos,
                        full,
                        seconds,
                        args.wrk,
                        Path(tmp),
                        args.device,
                        args.max_batch,
                        args.quick,
                        loads,
                        poisson,
                        (args.profile, args.out) if args.profile > 0 else None,
                    )
                except (Exception, SystemExit):  # report what was measured before the failure
                    traceback.print_exc()
                report()
    report()
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
