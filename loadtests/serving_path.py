"""Per-request cost of the serving path: the gateway (trivial model, every feature on) against the
minimal FastAPI + OpenCV reference app, on 224 px JPEGs, with wrk (C) as the load generator so the
client's own CPU does not distort the ratio. Servers are interleaved within each repetition.
A second reference does the gateway's own image work (``reference_app --preprocess gateway``), so
the table tells that work's cost (the model's crop, scaled back up on a 224 px JPEG) apart from the
rest of the gateway's.

    python -m loadtests.serving_path --seconds 10 --repeat 3
    python -m loadtests.serving_path --decode-threads 2,4,8   # the decode pool's size, side by side
    python -m loadtests.serving_path --tracing 0.01,1 --baseline ../main-before   # what tracing costs
    python -m loadtests.serving_path --granian 1,2   # the same app under Granian (pip install granian)

With ``--tracing``, the traced gateways export to an OTLP/HTTP sink in this process that answers
without decoding (a collector's cost is not the gateway's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import cv2
import psutil
from skimage import data as skdata

from loadtests.harness.deployment import gateway
from loadtests.harness.http_load import stop_process, wait_ready
from loadtests.harness.otlp_receiver import OTLPReceiver
from loadtests.harness.reference_app import SAME_WORK
from loadtests.harness.resources import children, cpu_seconds
from loadtests.harness.wrk import parse
from service.tune.runner import free_port

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "image/jpeg"
local f = io.open("{path}", "rb")
wrk.body = f:read("*all")
f:close()
"""


@dataclass
class Result:
    name: str
    rates: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    """Server CPU seconds per 1,000 images."""
    client_cpu: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    errors: int = 0


def jpeg_224(folder: Path) -> Path:
    rgb = cv2.resize(skdata.chelsea(), (224, 224), interpolation=cv2.INTER_AREA)  # type: ignore[no-untyped-call]
    path = folder / "cat-224.jpg"
    path.write_bytes(cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    return path


@contextmanager
def _server(
    command: list[str], port: int, ready: str, what: str, env: dict[str, str] | None = None
) -> Iterator[tuple[int, str]]:
    """A server process on ``port``, once ``ready`` (a path) answers 200; stopped on exit."""
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{url}{ready}", 120, what)
        yield proc.pid, url
    finally:
        stop_process(proc)


def reference_server(preprocess: str = "minimal") -> AbstractContextManager[tuple[int, str]]:
    port = free_port()
    command = [sys.executable, "-m", "loadtests.harness.reference_app", "--port", str(port), "--preprocess", preprocess]
    return _server(command, port, "/docs", "reference app")


def gateway_server(
    args: list[str], models_dir: Path, cwd: Path | None = None
) -> AbstractContextManager[tuple[int, str]]:
    return gateway(["--model", "trivial", "--backend", "embedded", *args], models_dir, cwd)


def granian_server(workers: int, models_dir: Path) -> AbstractContextManager[tuple[int, str]]:
    """The gateway's app (the same settings as ``gateway_server``'s) served by Granian instead of
    uvicorn: its ASGI interface, uvloop, no access log. What uvicorn's protocol layer adds
    (``service.http.protocol``: header and body timeouts, counted disconnects) is not there."""
    granian = Path(sys.executable).with_name("granian")
    if not granian.exists():
        raise SystemExit("--granian: Granian is not installed here (pip install granian)")
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_MODEL": "trivial",
        "GATEWAY_BACKEND": "embedded",
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_LOG_LEVEL": "warning",
    }
    command = [str(granian), "--interface", "asgi", "--factory", "--workers", str(workers), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--loop", "uvloop", "--no-access-log", "service.server:app_from_environment"]
    return _server(command, port, "/readyz", "the gateway under Granian", env)


def _cpu(pid: int) -> float:
    """CPU seconds of the server and its worker processes (those still running)."""
    total = 0.0
    for process in children({pid}):
        with suppress(psutil.Error):
            total += cpu_seconds(process)
    return total


def run_wrk(url: str, pid: int, script: Path, seconds: float, connections: int, threads: int, result: Result) -> None:
    server_before = _cpu(pid)
    wrk = subprocess.Popen(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{int(seconds)}s",
            "--latency",
            "-s",
            str(script),
            f"{url}/classify",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    client = psutil.Process(wrk.pid)
    client_cpu = 0.0
    while wrk.poll() is None:
        try:
            client_cpu = sum(client.cpu_times()[:2])
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    out = parse(wrk.communicate()[0])
    server_cpu = _cpu(pid) - server_before
    result.errors += out.non_2xx
    result.rates.append(out.rate)
    result.server_cpu.append(1000 * server_cpu / max(out.requests, 1))
    result.client_cpu.append(1000 * client_cpu / max(out.requests, 1))
    result.p50_ms.append(out.latency_ms.get(50, float("nan")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--workers", default="1", help="gateway worker counts to measure, e.g. 1,2")
    parser.add_argument(
        "--decode-threads",
        default="",
        help="also measure one worker with each of these decode thread counts, e.g. 2,4,8",
    )
    parser.add_argument(
        "--tracing",
        default="",
        help="also measure one worker tracing at each of these sample ratios, e.g. 0.01,1",
    )
    parser.add_argument(
        "--granian",
        default="",
        help="also measure the gateway's app under Granian with each of these worker counts, e.g. 1,2",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (e.g. a git worktree of main) whose gateway is measured in the same run",
    )
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, OTLPReceiver(keep=False) as sink:
        script = Path(tmp) / "post.lua"
        script.write_text(LUA.format(path=jpeg_224(Path(tmp))))
        servers: dict[str, Callable[[], AbstractContextManager[tuple[int, str]]]] = {
            "reference (FastAPI + OpenCV)": reference_server,
            SAME_WORK: partial(reference_server, "gateway"),
        }
        if args.baseline is not None:
            servers[f"baseline gateway ({args.baseline.name}), 1 worker"] = partial(
                gateway_server, [], args.models_dir, args.baseline.resolve()
            )
        for n in (int(w) for w in args.workers.split(",")):
            servers[f"gateway, {n} worker{'s' if n > 1 else ''}"] = partial(
                gateway_server, ["--workers", str(n)], args.models_dir
            )
        for n in (int(w) for w in args.granian.split(",") if w):
            servers[f"gateway under Granian, {n} worker{'s' if n > 1 else ''}"] = partial(
                granian_server, n, args.models_dir
            )
        for n in (int(t) for t in args.decode_threads.split(",") if t):
            servers[f"gateway, 1 worker, {n} decode threads"] = partial(
                gateway_server, ["--preprocess-workers", str(n)], args.models_dir
            )
        for ratio in (float(r) for r in args.tracing.split(",") if r):
            servers[f"gateway, 1 worker, tracing {ratio:g}"] = partial(
                gateway_server,
                ["--tracing-endpoint", sink.endpoint, "--tracing-sample-ratio", str(ratio)],
                args.models_dir,
            )
        results = {name: Result(name) for name in servers}
        for _ in range(args.repeat):
            for name, start in servers.items():
                with start() as (pid, url):
                    run_wrk(url, pid, script, 2, args.connections, args.threads, Result("warm-up"))
                    run_wrk(url, pid, script, args.seconds, args.connections, args.threads, results[name])
    reference = statistics.median(next(iter(results.values())).rates)
    same_work = statistics.median(results[SAME_WORK].rates)
    print(
        f"\n{os.cpu_count()} cores, wrk -t{args.threads} -c{args.connections} -d{args.seconds:g}s, 224 px JPEG, "
        f"trivial model, medians of {args.repeat} interleaved runs\n"
    )
    print(
        "| server | img/s | vs reference | vs reference, same image work | each run | p50 ms | server CPU ms/img "
        "| wrk CPU ms/img | non-2xx |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results.values():
        rate = statistics.median(r.rates)
        print(
            f"| {r.name} | {rate:,.0f} | {rate / reference:.2f} | {rate / same_work:.2f} "
            f"| {' '.join(f'{x:,.0f}' for x in r.rates)} "
            f"| {statistics.median(r.p50_ms):.1f} "
            f"| {statistics.median(r.server_cpu):.2f} | {statistics.median(r.client_cpu):.2f} | {r.errors} |"
        )
    if sink.requests:
        print(f"\ntraces: {sink.requests:,} OTLP exports, {sink.bytes / 1e6:,.1f} MB received by the sink")


if __name__ == "__main__":
    main()
