"""The gateway in front of Triton against NVIDIA's perf_analyzer on the same Triton, in one run.

The study's (docs/study.md) comparison: the perf client (raw tensors, no files) reached 458 img/s and the async gRPC
application (JPEG files) 410 img/s, a ratio of 0.895. Here, for each model:

* (a) perf_analyzer, gRPC, batch --batch-size, raw uint8 tensors, at several concurrencies;
* (b) the gateway (backend=triton) with HTTP clients posting 224x224 JPEGs (pre-resized, as the
  study did), over gRPC, gRPC + system shared memory, and HTTP to Triton;

the peak of each, the ratio b/a, and the batch-1 single-client latency of both (what the gateway
adds). ``trivial`` is the gateway-bound case, ``resnet50`` (random weights) the model-bound one.
Triton runs the ``python`` repository variant (ONNX Runtime on CPU), the only backend of the
tritonserver binary that installs here; on a GPU host point --triton-repo at a tensorrt repository.

    scripts/perf-analyzer   # once
    python -m loadtests.triton_vs_perf_analyzer --models trivial,resnet50
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import cv2
import numpy as np

from loadtests.harness.deployment import gateway, local_triton
from loadtests.harness.http_load import Row, http_load
from loadtests.harness.perf_analyzer import PA_DIR, Point, perf_analyzer
from loadtests.harness.photos import sample_photos
from service.images.preprocess import centre_crop_resize
from service.triton.repository import TritonOptions


def gateway_point(url: str, pid: int, photos: list[bytes], concurrency: int, images: int, client: str) -> Point:
    row: Row = asyncio.run(http_load(url, pid, photos, concurrency, images, client))
    return Point(client, concurrency, row.rate, row.percentile(0.5), row.percentile(0.99))


def small_jpegs() -> list[bytes]:
    """The sample photos centre-cropped and resized to 224x224, as the study (docs/study.md) pre-resized its data."""
    out = []
    for _, data in sample_photos():
        rgb = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert rgb is not None
        ok, buf = cv2.imencode(".jpg", centre_crop_resize(rgb, 224, 0.875), [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        out.append(buf.tobytes())
    return out


def run_model(args: argparse.Namespace, model: str, models_dir: Path, workdir: Path) -> list[str]:
    options = TritonOptions(
        variant="python",
        max_batch_size=max(64, args.batch_size),
        preferred_batch_sizes=(args.batch_size,),
        max_queue_delay_us=2000,
    )
    photos = small_jpegs()
    images = args.images[model] if isinstance(args.images, dict) else args.images
    points: list[Point] = []
    with local_triton(model, options, models_dir, workdir) as triton:
        pa_one = perf_analyzer(triton.grpc_url, model, 1, 1, args.interval_ms, shm=False)
        for c in args.concurrency:
            points.append(perf_analyzer(triton.grpc_url, model, args.batch_size, c, args.interval_ms, shm=False))
        gateways = [
            ("gateway grpc", ["--triton-url", triton.grpc_url]),
            ("gateway grpc shm", ["--triton-url", triton.grpc_url, "--triton-shared-memory"]),
            ("gateway http", ["--triton-url", triton.http_url, "--triton-protocol", "http"]),
        ]
        gw_one = None
        for client, extra in gateways:
            serve = [
                *("--backend", "triton", "--model", model, "--max-batch-size", str(args.batch_size)),
                *("--max-inflight-batches", str(args.inflight), "--max-queue-size", "4096", "--max-delay", "0.005"),
                *extra,
            ]
            with gateway(serve, models_dir) as (pid, url):
                if gw_one is None:
                    gw_one = gateway_point(url, pid, photos, 1, max(20, images // 8), "gateway grpc")
                for c in args.concurrency:
                    points.append(gateway_point(url, pid, photos, c * args.batch_size, images, client))
    assert gw_one is not None
    lines = [
        f"\n### {model}: batch size {args.batch_size}, {os.cpu_count()} cores\n",
        "| client | in flight (images) | img/s | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in points:
        in_flight = p.concurrency * (args.batch_size if p.client.startswith("perf") else 1)
        lines.append(f"| {p.client} | {in_flight} | {p.rate:.1f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} |")
    best: dict[str, Point] = {}
    for p in points:
        if p.rate > best.get(p.client, Point("", 0, 0, 0, 0)).rate:
            best[p.client] = p
    reference = best["perf_analyzer grpc"]
    lines += ["", "| peak | img/s | ratio to perf_analyzer |", "|---|---:|---:|"]
    for client, p in best.items():
        lines.append(
            f"| {client} (in flight {p.concurrency * (args.batch_size if client.startswith('perf') else 1)})"
            f" | {p.rate:.1f} | {p.rate / reference.rate:.3f} |"
        )
    lines += [
        "",
        f"batch 1, one client: perf_analyzer p50 {pa_one.p50_ms:.2f} ms, gateway (JPEG in, labels out) "
        f"p50 {gw_one.p50_ms:.2f} ms: the gateway adds {gw_one.p50_ms - pa_one.p50_ms:.2f} ms",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="trivial,resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--inflight", type=int, default=2, help="gateway --max-inflight-batches")
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4],
        help="perf_analyzer concurrencies; the gateway runs batch-size x each as HTTP clients",
    )
    parser.add_argument("--images", type=int, default=None, help="images per gateway point (default per model)")
    parser.add_argument("--interval-ms", type=int, default=4000, help="perf_analyzer measurement window")
    args = parser.parse_args()
    if not (PA_DIR / "perf_analyzer").exists():
        raise SystemExit(f"no perf_analyzer in {PA_DIR}: run scripts/perf-analyzer")
    models = args.models.split(",")
    if args.images is None:
        args.images = {"trivial": 1600, "resnet50": 160, "efficientnet-lite0": 480}
    models_dir = Path(tempfile.gettempdir()) / "gateway-bench-models"
    with tempfile.TemporaryDirectory() as workdir:
        report = []
        for model in models:
            report += run_model(args, model, models_dir, Path(workdir))
    print("\n".join(report))


if __name__ == "__main__":
    main()
