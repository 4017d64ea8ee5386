"""Goodput against offered load, from a quarter of capacity to 8x: the gateway beside LitServe and
BentoML doing the same job (``loadtests/peers``: the same ONNX file, OpenCV decode and crop, each
framework's own dynamic batching, each in its own pinned environment, installed on first use).

Capacity (1x) is the gateway's admission, ``GATEWAY_MAX_CONCURRENT_REQUESTS`` (64): in a closed
loop, 1x is 64 connections each sending its next photo when its answer comes (and at once after a
refusal: these clients ignore ``Retry-After``); in an open loop (Poisson arrivals,
``loadtests.harness.loadgen``), 1x is the gateway's own goodput at 64 connections, measured first in
the same run. Every server gets the same loads, one after the other, on the same 2 cores as the
load generator.

For each point: goodput (answers 200 per second), the latency of those answers (p50, p99; from the
scheduled arrival in the open loop), refusals per second (429 and 503), failures (no answer or
5xx), the server's CPU (its processes and their children), and for the gateway the p99 of its
refusals as it measured them (``gateway_http_request_duration_seconds``, 4xx of /classify).

    python -m loadtests.overload_goodput --seconds 10 --plot docs/performance/overload_goodput.png

``--gateway-cwd DIR`` runs the gateway of another checkout (a baseline, e.g. a ``git worktree``);
``--servers gateway`` skips the peers. ``--low-load`` measures the other end instead: the gateway
alone, 8 connections in a closed loop posting a 224 px JPEG (raw body), its goodput, p50 and p99,
the cores it used and its mean batch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from loadtests.harness import loadgen
from loadtests.harness.deployment import gateway
from loadtests.harness.open_loop import jpeg_224
from loadtests.harness.overload import quantile_bound, refusal_buckets
from loadtests.harness.peers import PEERS, labels_file, peer
from loadtests.harness.resources import children, cpu_seconds
from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.settings import Settings

FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
ADMITTED = 64
OPEN_CONNECTIONS = 960
"""The open loop's connections, as many as independent clients would have (under the gateway's
``GATEWAY_MAX_CONNECTIONS``, 1000): arrivals that find them all busy wait for one, in their latency,
and the gateway leaves a refused connection unread for its Retry-After."""
BOUNDARY = "goodput0boundary"


def photo() -> bytes:
    """A phone-like photo: scikit-image's astronaut at 1280 px with sensor noise, JPEG quality 90
    (about 300 KB)."""
    from skimage import data

    astronaut = np.asarray(data.astronaut())  # type: ignore[no-untyped-call]
    rgb = cv2.resize(astronaut[:, :, ::-1], (1280, 1280), interpolation=cv2.INTER_CUBIC)
    noisy = np.clip(rgb + np.random.default_rng(0).normal(0, 3, rgb.shape), 0, 255).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes()


def multipart(body: bytes) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="photo.jpg"\r\n'
        f"Content-Type: image/jpeg\r\n\r\n".encode()
        + body
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


@dataclass
class Point:
    server: str
    mode: str
    """closed (by connections) or open (Poisson arrivals)."""
    factor: float
    offered: float
    """Connections (closed) or arrivals per second (open)."""
    goodput: float
    p50_ms: float
    p99_ms: float
    refused_per_s: float
    failed: int
    cores: float
    refusal_p99_ms: float = math.nan
    """The gateway's own: the upper bound of the bucket of its refusals' p99."""

    def row(self) -> str:
        offered = f"{self.offered:.0f} conns" if self.mode == "closed" else f"{self.offered:.0f}/s"
        refusal = "-" if math.isnan(self.refusal_p99_ms) else f"<= {self.refusal_p99_ms:g}"
        return (
            f"| {self.server} | {self.mode} | {self.factor:g}x | {offered} | {self.goodput:.1f} | "
            f"{self.p50_ms:.0f} | {self.p99_ms:.0f} | {self.refused_per_s:.0f} | {self.failed} | "
            f"{self.cores:.2f} | {refusal} |"
        )


HEADER = (
    "| server | loop | load | offered | goodput img/s | p50 ms | p99 ms | refused/s | failed | server cores "
    "| refusal p99 ms (server) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _refusal_buckets(base: str) -> dict[float, float]:
    try:
        return refusal_buckets(urllib.request.urlopen(base + "/metrics", timeout=5).read().decode())
    except OSError:
        return {}


def measure(
    server: str, pid: int, url: str, body: bytes, mode: str, factor: float, offered: float, seconds: float
) -> Point:
    base = url.rsplit("/", 1)[0]
    pids = children({pid})
    cpu0 = sum(cpu_seconds(p) for p in pids)
    buckets0 = _refusal_buckets(base) if server.startswith("gateway") else {}
    load = loadgen.Load(
        url=url,
        body=body,
        content_type=f"multipart/form-data; boundary={BOUNDARY}",
        connections=int(offered) if mode == "closed" else OPEN_CONNECTIONS,
        rate=None if mode == "closed" else offered,
        seconds=seconds,
        warmup=1.0 if mode == "open" else 0.0,
    )
    result = loadgen.run(load)
    span = max(load.seconds, result.finished)
    cores = (sum(cpu_seconds(p) for p in children({pid}) | pids if _alive(p)) - cpu0) / (span + load.warmup)
    refused = sum(n for status, n in result.statuses.items() if status in (429, 503))
    failed = sum(n for status, n in result.statuses.items() if status not in (200, 429, 503))
    refusal = (
        quantile_bound(_refusal_buckets(base), 0.99, before=buckets0) * 1000
        if server.startswith("gateway")
        else math.nan
    )
    return Point(
        server,
        mode,
        factor,
        offered,
        result.goodput,
        result.percentile_ms(50),
        result.percentile_ms(99),
        refused / span,
        failed,
        cores,
        refusal,
    )


def _alive(pid: int) -> bool:
    with contextlib.suppress(Exception):
        cpu_seconds(pid)
        return True
    return False


@contextlib.contextmanager
def server(name: str, models: Path, model: Path, folder: Path, gateway_cwd: Path | None) -> Iterator[tuple[int, str]]:
    if name == "gateway":
        args = ["--model", "efficientnet-lite0", "--max-concurrent-requests", str(ADMITTED)]
        with gateway(args, models, cwd=gateway_cwd) as (pid, base):
            yield pid, base + "/classify"
    else:
        with peer(name, model, labels_file(folder)) as found:
            yield found


def run(
    servers: list[str], seconds: float, factors: tuple[float, ...], modes: list[str], gateway_cwd: Path | None
) -> list[Point]:
    body = multipart(photo())
    points: list[Point] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = Settings(**{}).models_dir  # the gateway's own cache (GATEWAY_MODELS_DIR)
        model = ensure_model(models, get_profile("efficientnet-lite0"))
        capacity: float | None = None
        for name in servers:
            with server(name, models, model, folder, gateway_cwd) as (pid, url):
                measure(name, pid, url, body, "closed", 1.0, ADMITTED, 3.0)  # warm-up, not counted
                for mode in modes:
                    for factor in factors:
                        if mode == "open" and capacity is None:
                            raise SystemExit("the open loop needs the gateway's capacity: run the gateway first")
                        offered = factor * ADMITTED if mode == "closed" else factor * (capacity or 0.0)
                        point = measure(name, pid, url, body, mode, factor, offered, seconds)
                        print(point.row(), flush=True)
                        points.append(point)
                        if name == "gateway" and mode == "closed" and factor == 1.0:
                            capacity = point.goodput
    return points


def plot(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({p.mode for p in points})
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 7), squeeze=False, sharex=True)
    for column, mode in enumerate(modes):
        for index, name in enumerate(dict.fromkeys(p.server for p in points)):
            mine = [p for p in points if p.server == name and p.mode == mode]
            x, colour = [p.factor for p in mine], f"C{index}"
            axes[0][column].plot(x, [p.goodput for p in mine], marker="o", color=colour, label=name)
            axes[1][column].plot(x, [p.p99_ms for p in mine], marker="o", color=colour, label=f"{name} p99")
            axes[1][column].plot(
                x, [p.p50_ms for p in mine], marker=".", linestyle=":", color=colour, label=f"{name} p50"
            )
        loop = "closed loop (connections)" if mode == "closed" else "open loop (Poisson arrivals)"
        axes[0][column].set_title(f"{loop}: goodput")
        axes[0][column].set_ylabel("answers 200 per second")
        axes[1][column].set_ylabel("latency of answers 200, ms")
        axes[1][column].set_yscale("log")
        axes[1][column].set_xlabel("offered load, x the gateway's capacity")
        for row in axes:
            row[column].set_xscale("log", base=2)
            row[column].grid(True, alpha=0.3)
            row[column].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def low_load(seconds: float, gateway_cwd: Path | None, connections: int = 8) -> str:
    """The gateway at low load: ``connections`` clients, a 224 px JPEG each, closed loop."""
    models = Settings(**{}).models_dir
    ensure_model(models, get_profile("efficientnet-lite0"))
    with gateway(["--model", "efficientnet-lite0"], models, cwd=gateway_cwd) as (pid, base):
        load = loadgen.Load(url=base + "/classify", body=jpeg_224(), connections=connections, seconds=3.0)
        loadgen.run(load)  # warm-up
        before, cpu0 = _batches(base), cpu_seconds(pid)
        result = loadgen.run(
            loadgen.Load(url=base + "/classify", body=jpeg_224(), connections=connections, seconds=seconds)
        )
        cores = (cpu_seconds(pid) - cpu0) / result.elapsed
        after = _batches(base)
    batches = after[1] - before[1]
    mean = (after[0] - before[0]) / batches if batches else math.nan
    return (
        f"low load, {connections} connections, 224 px JPEG: {result.goodput:.1f} img/s, "
        f"p50 {result.percentile_ms(50):.1f} ms, p99 {result.percentile_ms(99):.1f} ms, {cores:.2f} cores, "
        f"mean batch {mean:.2f}, {result.errors} errors"
    )


def _batches(base: str) -> tuple[float, float]:
    """(images, batches) the gateway has sent its backend."""
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for part in found:
            if line.startswith(f"gateway_batch_size_{part}{{"):
                found[part] += float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="per point")
    parser.add_argument("--servers", default=",".join(("gateway", *PEERS)))
    parser.add_argument("--modes", default="closed,open")
    parser.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS))
    parser.add_argument("--gateway-cwd", type=Path, help="run the gateway of this checkout (a baseline)")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--low-load", action="store_true", help="the gateway at 8 connections, 224 px, instead")
    args = parser.parse_args()
    if args.low_load:
        print(low_load(args.seconds, args.gateway_cwd))
        return
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - {"gateway", *PEERS}
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from gateway, {', '.join(PEERS)}")
    factors = tuple(float(f) for f in args.factors.split(","))
    print(HEADER, flush=True)
    points = run(servers, args.seconds, factors, args.modes.split(","), args.gateway_cwd)
    if args.plot is not None:
        plot(points, args.plot)
        print(f"plot: {args.plot}")
    at = {(p.server, p.mode, p.factor): p for p in points}
    for name in servers:
        base = at.get((name, "closed", 1.0))
        if base is None or not base.goodput:
            continue
        ratios = ", ".join(
            f"{f:g}x: {at[(name, 'closed', f)].goodput / base.goodput:.2f}"
            for f in factors
            if (name, "closed", f) in at
        )
        print(f"{name}: closed-loop goodput / its own at 1x: {ratios}")


if __name__ == "__main__":
    main()
