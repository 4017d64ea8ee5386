"""NVIDIA's perf_analyzer pointed at the gateway, at 1 image per request, in one run: the gateway's
Open Inference Protocol over gRPC and over HTTP (``/v2/models/{m}/infer``, a JPEG as the ``IMAGE``
BYTES element), the same tool on the Triton behind it (the model's own tensor input, as
``loadtests.triton_vs_perf_analyzer`` sends it), and the project's load generator
(``loadtests.harness.loadgen``) on ``/classify``, at each concurrency.

What it answers: what the gateway in front of Triton costs against Triton alone, and what a gRPC
request costs the gateway against an HTTP ``/classify`` one (the issue's goal: no dearer). CPU per
image is the gateway process's (and Triton's, its Python backend's stubs included) over each
measurement, divided by the requests the server itself counted meanwhile (its statistics
extension), so perf_analyzer's warm-up windows are on both sides of the division.

Each point runs ``--repeat`` times (rounds over every concurrency and target, so drift hits them
alike); the table has the run of median throughput. With ``--no-triton`` the gateway runs its
embedded backend and the Triton rows are left out (hosts without ``scripts/triton-venv``).

    scripts/perf-analyzer   # once
    python -m loadtests.perf_analyzer_gateway                  # trivial, concurrency 1,2,4,8,16
    python -m loadtests.perf_analyzer_gateway --quick          # a smoke run: 1,2, short windows
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psutil

from loadtests.harness.deployment import Triton, gateway, gateway_args, gateway_batching, local_triton
from loadtests.harness.loadgen import Load, run
from loadtests.harness.perf_analyzer import PA_DIR, bytes_input, perf_analyzer, request_counts
from loadtests.harness.photos import SAMPLE_PHOTOS, sample_photos
from loadtests.harness.resources import children, cpu_seconds
from service.tune.runner import free_port

GATEWAY_V2 = "gateway /v2 infer"
CLASSIFY = "gateway /classify"
TRITON = "Triton direct"


@dataclass
class Measured:
    """One target at one concurrency: what the client measured, what the servers spent."""

    target: str
    client: str
    protocol: str
    concurrency: int
    rate: float
    p50_ms: float
    p99_ms: float
    gateway_cpu_ms: float | None
    """Gateway process CPU per request the counting server answered (None: not in the path)."""
    triton_cpu_ms: float | None
    mean_batch: float
    """Images per backend execution, as the counting server says: the gateway's batches to its
    backend, or Triton's own for the direct rows."""
    failed: int
    """Requests the counting server (or the load generator) saw fail during the point."""


@dataclass
class Servers:
    model: str
    gateway_pid: int
    gateway_url: str
    """http://host:port of the gateway's REST port."""
    grpc: str
    """host:port of the gateway's gRPC front."""
    triton: Triton | None


Probe = Callable[[], tuple[float, float, float, int]]
"""One measurement: (requests/s, p50 ms, p99 ms, failures the client saw)."""


def tree_cpu(pid: int | None) -> float:
    """CPU seconds of a process and its children (Triton's Python-backend stubs); 0 for None."""
    if pid is None:
        return 0.0
    total = 0.0
    for each in children({pid}):
        try:
            total += cpu_seconds(each)
        except psutil.Error:  # a child that ended between listing and reading
            continue
    return total


def point(servers: Servers, target: str, client: str, protocol: str, concurrency: int, probe: Probe) -> Measured:
    """Run ``probe``, with the CPU both servers spent and the requests the one measured counted."""
    triton_pid = servers.triton.pid if servers.triton is not None else None
    counter = servers.gateway_url
    if target == TRITON and servers.triton is not None:
        counter = f"http://{servers.triton.http_url}"
    before = request_counts(counter, servers.model)
    gateway0, triton0 = tree_cpu(servers.gateway_pid), tree_cpu(triton_pid)
    rate, p50, p99, client_failed = probe()
    gateway1, triton1 = tree_cpu(servers.gateway_pid), tree_cpu(triton_pid)
    counted = request_counts(counter, servers.model) - before
    served = max(counted.succeeded, 1)
    return Measured(
        target,
        client,
        protocol,
        concurrency,
        rate,
        p50,
        p99,
        None if target == TRITON else 1000 * (gateway1 - gateway0) / served,
        None if triton_pid is None else 1000 * (triton1 - triton0) / served,
        counted.inferences / max(counted.executions, 1),
        counted.failed + client_failed,
    )


def targets(
    servers: Servers, args: argparse.Namespace, data: Path, photo: bytes
) -> list[tuple[str, str, str, Callable[[int], Probe]]]:
    """(target, client, protocol, probe at a concurrency) for each row kind of the table."""

    def pa(url: str, model: str, protocol: str, input_data: Path | None) -> Callable[[int], Probe]:
        def at(concurrency: int) -> Probe:
            def probe() -> tuple[float, float, float, int]:
                p = perf_analyzer(
                    url, model, 1, concurrency, args.interval_ms, False, protocol=protocol, input_data=input_data
                )
                return p.rate, p.p50_ms, p.p99_ms, 0

            return probe

        return at

    def loadgen(concurrency: int) -> Probe:
        def probe() -> tuple[float, float, float, int]:
            load = Load(f"{servers.gateway_url}/classify", photo, connections=concurrency, seconds=args.loadgen_seconds)
            result = run(load)
            return result.throughput, result.percentile_ms(50), result.percentile_ms(99), result.errors

        return probe

    rest = servers.gateway_url.removeprefix("http://")
    rows = [
        (GATEWAY_V2, "perf_analyzer", "grpc", pa(servers.grpc, servers.model, "grpc", data)),
        (GATEWAY_V2, "perf_analyzer", "http", pa(rest, servers.model, "http", data)),
        (CLASSIFY, "loadgen", "http", loadgen),
    ]
    if servers.triton is not None:
        for protocol in args.triton_protocols:
            url = servers.triton.grpc_url if protocol == "grpc" else servers.triton.http_url
            rows.append((TRITON, "perf_analyzer", protocol, pa(url, servers.model, protocol, None)))
    return rows


def measure(servers: Servers, args: argparse.Namespace, data: Path, photo: bytes) -> list[Measured]:
    """Every target at every concurrency, ``args.repeat`` rounds; the median-throughput run of each."""
    runs: dict[tuple[str, str, int], list[Measured]] = {}
    kinds = targets(servers, args, data, photo)
    for round_ in range(args.repeat):
        for concurrency in args.concurrency:
            for target, client, protocol, at in kinds:
                m = point(servers, target, client, protocol, concurrency, at(concurrency))
                runs.setdefault((target, protocol, concurrency), []).append(m)
                print(
                    f"round {round_ + 1}: {target} {protocol} c{concurrency}: {m.rate:.1f}/s "
                    f"p50 {m.p50_ms:.2f} ms p99 {m.p99_ms:.2f} ms",
                    flush=True,
                )
    chosen = []
    for found in runs.values():
        ordered = sorted(found, key=lambda m: m.rate)
        median = ordered[len(ordered) // 2]
        median.failed = sum(m.failed for m in found)
        chosen.append(median)
    return chosen


def cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(results: list[Measured], args: argparse.Namespace, backend: str) -> list[str]:
    """The table, the side-by-side ratios per concurrency, their medians, and the goal's verdict."""
    lines = [
        f"\n### {args.model}, 1 image per request, gateway backend {backend}, {os.cpu_count()} cores, "
        f"median of {args.repeat} run(s)\n",
        "| target | client | protocol | concurrency | infer/s | p50 ms | p99 ms "
        "| gateway CPU ms/image | Triton CPU ms/image | mean batch |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        lines.append(
            f"| {m.target} | {m.client} | {m.protocol} | {m.concurrency} | {m.rate:.1f} | {m.p50_ms:.2f} | "
            f"{m.p99_ms:.2f} | {cell(m.gateway_cpu_ms)} | {cell(m.triton_cpu_ms)} | {m.mean_batch:.2f} |"
        )
    at = {(m.target, m.protocol, m.concurrency): m for m in results}
    triton = args.triton_protocols if backend == "triton" else []
    head = ["concurrency", "gRPC / /classify CPU", "HTTP v2 / /classify CPU", "gRPC / HTTP v2 infer/s"]
    head += [f"gateway / Triton {p} infer/s" for p in triton]
    head += [f"gateway / Triton {p} p99" for p in triton]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    columns: list[list[float]] = [[] for _ in head[1:]]
    for c in args.concurrency:
        grpc, http, classify = at[(GATEWAY_V2, "grpc", c)], at[(GATEWAY_V2, "http", c)], at[(CLASSIFY, "http", c)]
        row = [ratio(grpc.gateway_cpu_ms, classify.gateway_cpu_ms), ratio(http.gateway_cpu_ms, classify.gateway_cpu_ms)]
        row.append(ratio(grpc.rate, http.rate))
        row += [ratio(at[(GATEWAY_V2, p, c)].rate, at[(TRITON, p, c)].rate) for p in triton]
        row += [ratio(at[(GATEWAY_V2, p, c)].p99_ms, at[(TRITON, p, c)].p99_ms) for p in triton]
        for column, value in zip(columns, row, strict=True):
            column.append(value)
        lines.append(f"| {c} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    lines.append("| median | " + " | ".join(f"{statistics.median(v):.3f}" for v in columns) + " |")
    cpu = statistics.median(columns[0])
    lines += [
        "",
        f"goal, gRPC no dearer than HTTP /classify per image (gateway CPU): {'met' if cpu <= 1.0 else 'NOT met'} "
        f"(median ratio {cpu:.3f})",
        f"failed requests: {sum(m.failed for m in results)}",
    ]
    return lines


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def load_photo(name: str) -> bytes:
    """A file's bytes, or one of the sample photos by name (``chelsea``: a 451x300 JPEG)."""
    path = Path(name)
    if path.is_file():
        return path.read_bytes()
    for found, data in sample_photos():
        if found.removesuffix(".jpg") == name:
            return data
    raise SystemExit(f"--photo {name}: neither a file nor one of {', '.join(SAMPLE_PHOTOS)}")


def positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number")
        return value

    return parse


def concurrencies(text: str) -> list[int]:
    values = [int(positive(int)(part)) for part in text.split(",")]
    if len(values) > 32 or max(values) > 1024:
        raise argparse.ArgumentTypeError("at most 32 concurrencies, each at most 1024")
    return values


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.perf_analyzer_gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="trivial", help="model profile served (trivial: the gateway-bound case)")
    parser.add_argument("--concurrency", type=concurrencies, default=[1, 2, 4, 8, 16])
    parser.add_argument("--interval-ms", type=positive(int), default=3000, help="perf_analyzer's measurement window")
    parser.add_argument("--loadgen-seconds", type=positive(float), help="each /classify run (default: 3 windows)")
    parser.add_argument("--repeat", type=positive(int), default=3, help="runs of each point (the median is shown)")
    parser.add_argument("--photo", default="chelsea", help="a JPEG/PNG file, or a sample photo's name")
    parser.add_argument("--triton-protocols", type=lambda s: s.split(","), default=["grpc", "http"])
    parser.add_argument("--no-triton", action="store_true", help="gateway on its embedded backend; no Triton rows")
    parser.add_argument("--quick", action="store_true", help="a smoke run: concurrency 1,2, 500 ms windows, 1 run")
    args = parser.parse_args(argv)
    if any(p not in ("grpc", "http") for p in args.triton_protocols):
        parser.error("--triton-protocols: grpc, http or both")
    if args.quick:
        args.concurrency, args.interval_ms, args.repeat = [1, 2], 500, 1
    args.interval_ms = int(args.interval_ms)
    args.repeat = int(args.repeat)
    if args.loadgen_seconds is None:
        args.loadgen_seconds = 3 * args.interval_ms / 1000
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if not (PA_DIR / "perf_analyzer").exists():
        raise SystemExit(f"no perf_analyzer in {PA_DIR}: run scripts/perf-analyzer")
    photo = load_photo(args.photo)
    models_dir = Path(tempfile.gettempdir()) / "gateway-bench-models"
    largest = max(args.concurrency)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        workdir = Path(work)
        triton = None
        if not args.no_triton:
            triton = stack.enter_context(local_triton(args.model, gateway_batching((largest,)), models_dir, workdir))
        grpc_port = free_port()
        serve = gateway_args(args.model, largest, largest, triton, "grpc")
        pid, url = stack.enter_context(gateway(serve, models_dir, env={"GATEWAY_GRPC_PORT": str(grpc_port)}))
        servers = Servers(args.model, pid, url, f"127.0.0.1:{grpc_port}", triton)
        data = bytes_input("IMAGE", [photo], workdir / "image.json")
        results = measure(servers, args, data, photo)
    lines = report(results, args, "embedded" if triton is None else "triton")
    lines.append(f"photo: {len(photo):,} bytes; run took {time.monotonic() - started:.0f} s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
