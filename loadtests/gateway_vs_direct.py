"""Throughput and latency of the gateway against calling the embedded backend directly.

Same photos, same model, same batch size, in one run:

* ``direct: model only``: pre-decoded tensors, batches of --batch-size straight into ONNX Runtime
  (the study's (docs/study.md) "(1) without files");
* ``direct: decode + model``: decode and resize each photo, then infer in batches, one thread
  (the study's (docs/study.md) simple architecture, synchronous);
* ``gateway cN``: a real gateway process, N HTTP clients each posting one JPEG at a time.

    python -m loadtests.gateway_vs_direct --batch-size 16 --concurrency 1,4,16,64 --requests 480 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtests.harness.deployment import gateway
from loadtests.harness.http_load import Row, http_load, median_row
from loadtests.harness.photos import sample_photos
from service.backends.embedded import EmbeddedBackend
from service.images.preprocess import PreprocessConfig, prepare
from service.models.profiles import get_profile
from service.models.store import ensure_model


async def direct_rows(model_path: Path, photos: list[bytes], batch: int, images: int, threads: int) -> list[Row]:
    backend = EmbeddedBackend(model_path, intra_op_threads=threads, max_concurrency=1)
    await backend.start()
    config = PreprocessConfig()
    tensors = [prepare(p, config) for p in photos]
    await backend.infer(np.stack(tensors[:1] * batch))  # warm-up
    rows = []
    for mode, decode in (("direct: model only", False), ("direct: decode + model", True)):
        latencies, done, start, cpu0 = [], 0, time.perf_counter(), time.process_time()
        while done < images:
            t0 = time.perf_counter()
            idx = [(done + i) % len(photos) for i in range(batch)]
            arrays = [prepare(photos[i], config) for i in idx] if decode else [tensors[i] for i in idx]
            await backend.infer(np.stack(arrays))
            latencies.append(time.perf_counter() - t0)
            done += batch
        cpu = time.process_time() - cpu0
        rows.append(Row(mode, done, time.perf_counter() - start, latencies, float(batch), server_cpu=cpu))
    await backend.aclose()
    return rows


def print_table(rows: list[Row], baseline: Row, repeats: int) -> None:
    def ms_per_image(cpu: float | None, r: Row) -> str:
        return f"{1000 * cpu / r.images:.1f}" if cpu is not None else "-"

    print(f"median of {repeats} interleaved runs per row")
    print(
        "| mode | img/s | vs direct decode+model | p50 ms | p99 ms | mean batch "
        "| server CPU ms/img | client CPU ms/img |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        batch = f"{r.mean_batch:.1f}" if r.mean_batch else "-"
        print(
            f"| {r.mode} | {r.rate:.1f} | {r.rate / baseline.rate:.2f} | "
            f"{r.percentile(0.5):.1f} | {r.percentile(0.99):.1f} | {batch} | "
            f"{ms_per_image(r.server_cpu, r)} | {ms_per_image(r.client_cpu, r)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-delay", type=float, default=0.005)
    parser.add_argument("--max-inflight-batches", type=int, default=2)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=480, help="images per row")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per row; the median is shown")
    parser.add_argument("--photos", type=Path, default=None, help="folder of photos (default: scikit-image's)")
    parser.add_argument("--models-dir", type=Path, default=None)
    args = parser.parse_args()

    photos = [data for _, data in sample_photos(args.photos)]
    models_dir = args.models_dir or Path(tempfile.gettempdir()) / "gateway-bench-models"
    model_path = ensure_model(models_dir, get_profile(args.model))
    print(
        f"model {args.model}, batch size {args.batch_size}, {len(photos)} photos, {os.cpu_count()} cores, "
        f"{args.requests} images per row",
        flush=True,
    )
    runs: dict[str, list[Row]] = {}
    gateway_args = [
        "--model",
        args.model,
        "--max-batch-size",
        str(args.batch_size),
        "--max-delay",
        str(args.max_delay),
        "--embedded-threads",
        str(args.threads),
        "--max-inflight-batches",
        str(args.max_inflight_batches),
        "--max-queue-size",
        str(max(256, 4 * max(args.concurrency))),
    ]
    with gateway(gateway_args, models_dir) as (pid, url):
        for _ in range(args.repeat):
            batch = asyncio.run(direct_rows(model_path, photos, args.batch_size, args.requests, args.threads))
            for c in args.concurrency:
                batch.append(asyncio.run(http_load(url, pid, photos, c, args.requests, f"gateway c{c}")))
            for row in batch:
                runs.setdefault(row.mode, []).append(row)
    rows = [median_row(r) for r in runs.values()]
    print_table(rows, baseline=rows[1], repeats=args.repeat)


if __name__ == "__main__":
    main()
