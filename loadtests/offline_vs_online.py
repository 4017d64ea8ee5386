"""Offline (RabbitMQ) throughput against online (HTTP) throughput, same backend and batch settings.

* online: a gateway process, --concurrency HTTP clients each posting one JPEG at a time;
* offline: one ``gateway worker`` process and the ingest client (run in this process, so its
  start-up is not counted) over the same images, timed from the first publish to the last result
  written: publish with confirm, queue, decode, batch, infer, result publish with confirm, ack, and
  the result back to the ingest client.

Rows alternate and repeat; the median run of each is shown, with the CPU each process spent per
image: on a small host the load generator and the broker share the cores with the gateway, so
where the offline path's time goes is part of the answer.

    python -m loadtests.offline_vs_online --images 480 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

from loadtests.clients import offline
from loadtests.deployment import broker_pid, gateway, worker
from loadtests.http_load import Row, http_load, median_row
from loadtests.photos import sample_photos
from loadtests.resources import cpu_seconds


def write_images(folder: Path, photos: list[bytes], count: int) -> list[bytes]:
    """``count`` distinct files (each photo re-encoded with a trailing comment byte pattern)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        data = photos[i % len(photos)] + b"\xff\xfe" + i.to_bytes(4, "big")  # bytes after EOI are ignored
        (folder / f"img-{i:05d}.jpg").write_bytes(data)
        out.append(data)
    return out


def offline_row(args: argparse.Namespace, folder: Path, models_dir: Path, images: int) -> Row:
    env = {
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_MODEL": args.model,
        "GATEWAY_MAX_BATCH_SIZE": str(args.batch_size),
    }
    broker = broker_pid()
    with worker(env) as (proc, settings), tempfile.TemporaryDirectory() as tmp:

        def cpu() -> tuple[float, float, float]:  # worker, client (this process), broker
            return cpu_seconds(proc.pid), time.process_time(), cpu_seconds(broker) if broker else float("nan")

        before = cpu()
        measurement = asyncio.run(offline(settings, sorted(folder.iterdir()), Path(tmp)))
        server, client, broker_cpu = (b - a for a, b in zip(before, cpu(), strict=True))
    assert measurement.images == images, f"{measurement.images} results for {images} images"
    return Row(
        "offline: ingest -> RabbitMQ -> worker",
        images,
        measurement.seconds,
        [measurement.seconds],
        client_cpu=client,
        server_cpu=server,
        broker_cpu=broker_cpu if broker else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--images", type=int, default=480)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    models_dir = Path(tempfile.gettempdir()) / "gateway-bench-models"
    photos = [data for _, data in sample_photos()]
    runs: dict[str, list[Row]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        images = write_images(folder, photos, args.images)
        serve = ["--model", args.model, "--max-batch-size", str(args.batch_size), "--max-queue-size", "1024"]
        with gateway(serve, models_dir) as (pid, url):
            for _ in range(args.repeat):
                online = asyncio.run(
                    http_load(
                        url, pid, images, args.concurrency, args.images, f"online: {args.concurrency} HTTP clients"
                    )
                )
                runs.setdefault(online.mode, []).append(online)
                os.kill(pid, signal.SIGSTOP)  # keep the idle gateway off the CPU while offline runs
                try:
                    offline = offline_row(args, folder, models_dir, args.images)
                finally:
                    os.kill(pid, signal.SIGCONT)
                runs.setdefault(offline.mode, []).append(offline)
    rows = [median_row(r) for r in runs.values()]
    print(
        f"model {args.model}, batch size {args.batch_size}, {args.images} images, {os.cpu_count()} cores, "
        f"median of {args.repeat} alternated runs"
    )
    print("| mode | img/s | ratio to online | gateway or worker CPU ms/img | client CPU ms/img | broker CPU ms/img |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.mode} | {r.rate:.1f} | {r.rate / rows[0].rate:.2f} | {r.per_image_ms(r.server_cpu)} "
            f"| {r.per_image_ms(r.client_cpu)} | {r.per_image_ms(r.broker_cpu)} |"
        )


if __name__ == "__main__":
    main()
