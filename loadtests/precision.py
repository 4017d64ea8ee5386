"""The simple architecture's runtimes and precisions side by side: ONNX Runtime FP32 (today's
embedded backend) against OpenVINO FP32, BF16 and INT8, on the same model and photos, in one run.

* accuracy: top-1 agreement with ONNX Runtime FP32 and the largest score difference, on photos with
  a clear FP32 answer (top class ahead by ``CLEAR_MARGIN``) and on all of them; a precision is
  "supported" at >= 99 % on the clear ones;
* the backend alone: img/s on decoded tensors at batch 1 and 16;
* through the gateway: photos in, labels out, N HTTP clients, at batch 1 and 16;
* cost per million images at ``--price-per-hour``.

Photos: distinct crops of scikit-image's sample photos (``loadtests.harness.dataset``), calibration and
evaluation sets from different seeds; or your own folders.

    python -m loadtests.precision --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtests.harness.backend_alone import backend_rate, scores_of
from loadtests.harness.dataset import build
from loadtests.harness.deployment import gateway
from loadtests.harness.http_load import Row, http_load, median_row
from service.backends.embedded import EmbeddedBackend
from service.backends.inprocess import InProcessBackend
from service.backends.openvino import OpenVINOBackend
from service.models.profiles import get_profile
from service.models.quantize import MIN_AGREEMENT, agreement, clear_answers, ensure_int8, model_inputs, photos_in
from service.models.store import ensure_model

RUNTIMES = ("onnxruntime fp32", "openvino fp32", "openvino bf16", "openvino int8")


@dataclass
class Rates:
    backend: dict[int, list[float]] = field(default_factory=dict)
    gateway: dict[int, list[Row]] = field(default_factory=dict)


def _backend(name: str, onnx: Path, int8: Path, threads: int) -> InProcessBackend:
    if name == "onnxruntime fp32":
        return EmbeddedBackend(onnx, intra_op_threads=threads)
    precision = name.split()[1]
    return OpenVINOBackend(int8 if precision == "int8" else onnx, precision=precision, threads=threads)  # type: ignore[arg-type]


def _gateway_flags(name: str, model: str, batch: int, calibration: Path) -> list[str]:
    flags = ["--model", model, "--max-batch-size", str(batch), "--calibration-dir", str(calibration)]
    if name == "onnxruntime fp32":
        return [*flags, "--backend", "embedded"]
    return [*flags, "--backend", "openvino", "--openvino-precision", name.split()[1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per figure; the median is shown")
    parser.add_argument("--images", type=int, default=480, help="images per gateway run")
    parser.add_argument("--concurrency", type=int, default=32, help="HTTP clients through the gateway")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per backend-alone run")
    parser.add_argument("--threads", type=int, default=0, help="runtime threads (0: every usable core)")
    parser.add_argument("--calibration", type=Path, help="calibration photos (default: 160 generated, seed 1)")
    parser.add_argument("--evaluation", type=Path, help="evaluation photos (default: 400 generated, seed 2)")
    parser.add_argument("--price-per-hour", type=float, default=0.085, help="$/h of the host (default: 2 vCPUs)")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))

    with tempfile.TemporaryDirectory() as tmp:
        calibration = args.calibration or build(Path(tmp) / "cal", count=160, seed=1).folder / "originals"
        evaluation = args.evaluation or build(Path(tmp) / "eval", count=400, seed=2).folder / "originals"
        profile = get_profile(args.model)
        onnx = ensure_model(args.models_dir, profile)
        int8 = ensure_int8(args.models_dir, profile, onnx, calibration)
        files = photos_in(evaluation)
        images = np.stack(model_inputs(files, profile))
        photos = [p.read_bytes() for p in files]

        scores = {name: asyncio.run(scores_of(_backend(name, onnx, int8, threads), images)) for name in RUNTIMES}
        rates = {name: Rates() for name in RUNTIMES}
        for _ in range(args.repeat):
            for name in RUNTIMES:
                for batch in (1, 16):
                    backend = _backend(name, onnx, int8, threads)
                    rate = asyncio.run(backend_rate(backend, images, batch, args.seconds))
                    rates[name].backend.setdefault(batch, []).append(rate)
                    flags = _gateway_flags(name, args.model, batch, calibration)
                    with gateway(flags, args.models_dir) as (pid, url):
                        row = asyncio.run(http_load(url, pid, photos, args.concurrency, args.images, name))
                    rates[name].gateway.setdefault(batch, []).append(row)
                    print(f"{name} batch {batch}: backend {rate:.1f} img/s, gateway {row.rate:.1f} img/s", flush=True)

    reference = scores["onnxruntime fp32"]
    clear = clear_answers(reference)
    print(
        f"\n{args.model}, {threads} threads, {len(files)} evaluation photos ({int(clear.sum())} with a clear answer, "
        f"{len(set(reference[clear].argmax(axis=1)))} classes), {args.concurrency} clients, "
        f"medians of {args.repeat} interleaved runs, ${args.price_per_hour:g}/h\n"
    )
    print(
        "| runtime | top-1 agreement (clear / all) | largest score diff | supported | backend img/s b1 | b16 "
        "| gateway img/s b1 | b16 | vs today (gateway b16) | $ per M images (gateway b16) |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    today = median_row(rates["onnxruntime fp32"].gateway[16]).rate
    for name in RUNTIMES:
        sure, every = agreement(reference[clear], scores[name][clear]), agreement(reference, scores[name])
        alone = {b: statistics.median(r) for b, r in rates[name].backend.items()}
        through = {b: median_row(r).rate for b, r in rates[name].gateway.items()}
        print(
            f"| {name} | {sure.top1:.1%} / {every.top1:.1%} | {every.max_score_diff:.4f} "
            f"| {'yes' if sure.top1 >= MIN_AGREEMENT else 'no'} | {alone[1]:.1f} | {alone[16]:.1f} "
            f"| {through[1]:.1f} | {through[16]:.1f} | {through[16] / today:.2f} "
            f"| {args.price_per_hour / 3600 / through[16] * 1e6:.3f} |"
        )


if __name__ == "__main__":
    main()
