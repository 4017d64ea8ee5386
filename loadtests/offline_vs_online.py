"""Offline (RabbitMQ) throughput against online (HTTP) throughput, same backend and batch settings.

Three rows per checkout, alternated and repeated, the median run of each shown:

* online: a gateway process, --concurrency HTTP clients each posting one JPEG at a time;
* offline, end to end: one ``gateway worker`` and ``gateway ingest``'s client over the same images,
  timed from the first publish to the last result written: publish with confirm, queue, decode,
  batch, infer, result publish with confirm, ack, and the result back to the ingest client;
* offline, drain: the worker alone on a queue filled while it was stopped (what bulk ingestion
  is once the queue is full), timed from its start to the last result in the broker.

Each row gives the CPU the serving process (gateway or worker), the client and RabbitMQ spent per
image: on a small host the load generator and the broker share the cores with the worker, so where
the offline path's time goes is part of the answer. ``--baseline DIR`` runs the same rows with the
gateway, worker and ingest client of another checkout (``git worktree add ../base main``).

``--serving-cpus N`` gives the serving process the last N CPUs and moves this process (the HTTP
clients, the ingest client) and RabbitMQ onto the others for the run: the gateway and the worker
then get the same CPU, and neither pays for its load generator or broker, as in a deployment where
RabbitMQ and the producers run on hosts of their own. Without it everything shares every core.

    python -m loadtests.offline_vs_online --images 1200 --repeat 3 --model trivial --baseline ../base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loadtests.harness.deployment import broker_pid, gateway, pinning, worker
from loadtests.harness.http_load import Row, http_load, median_row
from loadtests.harness.photos import sample_photos
from loadtests.harness.resources import cpu_seconds
from service.jobs.broker import Broker
from service.jobs.messages import new_job_id, request_message
from service.jobs.topology import REQUEST_KEY, Names
from service.settings import Settings

INGEST = """
import asyncio, json, sys, tempfile, time
from pathlib import Path
from loadtests.harness.clients import offline
from service.settings import Settings
try:
    from service.host.eventloop import run
except ImportError:  # a checkout from before the gateway's own event loop
    run = asyncio.run
settings = Settings.model_validate({"broker_url": sys.argv[1], "queue_prefix": sys.argv[2]})
files = sorted(Path(sys.argv[3]).iterdir())
with tempfile.TemporaryDirectory() as tmp:
    cpu = time.process_time()
    m = run(offline(settings, files, Path(tmp)))
    print(json.dumps({"images": m.images, "errors": m.errors, "seconds": m.seconds, "cpu": time.process_time() - cpu}))
"""
"""The ingest client, run in the checkout under test (its start-up is not counted)."""


def write_images(folder: Path, photos: list[bytes], count: int) -> list[bytes]:
    """``count`` distinct files (each photo with a trailing byte pattern)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        data = photos[i % len(photos)] + b"\xff\xfe" + i.to_bytes(4, "big")  # bytes after EOI are ignored
        (folder / f"img-{i:05d}.jpg").write_bytes(data)
        out.append(data)
    return out


class Sampler:
    """CPU seconds of the worker and of RabbitMQ between ``start`` and ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.broker = pid, broker_pid()

    def _now(self) -> tuple[float, float]:
        return cpu_seconds(self.pid), cpu_seconds(self.broker) if self.broker else float("nan")

    def start(self) -> None:
        self.before = self._now()

    def stop(self) -> tuple[float, float | None]:
        worker_cpu, broker_cpu = (b - a for a, b in zip(self.before, self._now(), strict=True))
        return worker_cpu, broker_cpu if self.broker else None


def end_to_end(label: str, tree: Path | None, settings: Settings, folder: Path, images: int, sampler: Sampler) -> Row:
    sampler.start()
    done = subprocess.run(
        [sys.executable, "-c", INGEST, settings.broker_url or "", settings.queue_prefix, str(folder)],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    worker_cpu, broker_cpu = sampler.stop()
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["images"] == images, f"{measured} for {images} images"
    assert not measured["errors"], f"{measured} for {images} images"
    seconds = measured["seconds"]
    return Row(label, images, seconds, [seconds], None, measured["cpu"], worker_cpu, broker_cpu)


async def _fill(settings: Settings, photos: list[bytes], reply_to: str) -> str:
    """Publish every image (confirmed) with results routed to a queue of their own; its name."""
    broker = Broker(settings.broker_url or "", Names(settings.queue_prefix))
    await broker.connect(timeout=30)
    assert broker.channel is not None
    assert broker.topology is not None
    sink = await broker.channel.declare_queue(f"{settings.queue_prefix}.{reply_to}", durable=True)
    await sink.purge()
    await sink.bind(broker.topology.results_exchange, reply_to)
    window = asyncio.Semaphore(256)

    async def publish(data: bytes) -> None:
        async with window:
            message = request_message(
                data, job_id=new_job_id(), content_type="image/jpeg", filename=None, top_k=5, reply_to=reply_to
            )
            await broker.publish("requests", message, REQUEST_KEY)

    await asyncio.gather(*(publish(data) for data in photos))
    await broker.aclose()
    return sink.name


async def _wait_for(settings: Settings, queue: str, count: int, timeout: float = 600) -> None:
    """Until ``queue`` holds ``count`` messages (asked every 20 ms: the broker counts, not us); then
    delete it."""
    broker = Broker(settings.broker_url or "", Names(settings.queue_prefix))
    await broker.connect(timeout=30)
    assert broker.channel is not None
    channel = await broker.channel.get_underlay_channel()
    async with asyncio.timeout(timeout):
        # the count is the broker's, asked over the wire: there is no event to wait on
        while ((await channel.queue_declare(queue=queue, passive=True)).message_count or 0) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    await channel.queue_delete(queue)
    await broker.aclose()


def drain(label: str, proc: subprocess.Popen[str], settings: Settings, photos: list[bytes], sampler: Sampler) -> Row:
    os.kill(proc.pid, signal.SIGSTOP)  # the queue fills while the worker takes nothing
    try:
        sink = asyncio.run(_fill(settings, photos, "drain"))
        sampler.start()
        started = time.perf_counter()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    asyncio.run(_wait_for(settings, sink, len(photos)))
    seconds = time.perf_counter() - started
    worker_cpu, broker_cpu = sampler.stop()
    return Row(label, len(photos), seconds, [seconds], None, None, worker_cpu, broker_cpu)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--images", type=int, default=480)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in the same run")
    parser.add_argument(
        "--serving-cpus",
        type=int,
        default=0,
        help="pin the gateway or worker to the last N CPUs, the clients and RabbitMQ to the rest (0: no pinning)",
    )
    args = parser.parse_args(argv)
    with pinning(args.serving_cpus) as serving:
        run(args, serving)


def run(args: argparse.Namespace, serving: set[int] | None) -> None:
    models_dir = Path(tempfile.gettempdir()) / "gateway-bench-models"
    trees: dict[str, Path | None] = {"this checkout": None}
    if args.baseline is not None:
        trees[f"baseline ({args.baseline.name})"] = args.baseline.resolve()
    photos = [data for _, data in sample_photos()]
    env = {"GATEWAY_MODELS_DIR": str(models_dir), "GATEWAY_MODEL": args.model}
    env["GATEWAY_MAX_BATCH_SIZE"] = str(args.batch_size)
    serve = ["--model", args.model, "--max-batch-size", str(args.batch_size), "--max-queue-size", "1024"]
    runs: dict[str, list[Row]] = {}

    def keep(row: Row) -> None:
        runs.setdefault(row.mode, []).append(row)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        images = write_images(folder, photos, args.images)
        for _ in range(args.repeat):
            for name, tree in trees.items():
                with gateway(serve, models_dir, cwd=tree, cpus=serving) as (pid, url):
                    keep(
                        asyncio.run(
                            http_load(
                                url,
                                pid,
                                images,
                                args.concurrency,
                                args.images,
                                f"{name}: online, {args.concurrency} HTTP clients",
                            )
                        )
                    )
                with worker(env, cwd=tree, cpus=serving) as (proc, settings):
                    sampler = Sampler(proc.pid)
                    keep(
                        end_to_end(
                            f"{name}: offline, ingest -> RabbitMQ -> worker",
                            tree,
                            settings,
                            folder,
                            args.images,
                            sampler,
                        )
                    )
                    keep(drain(f"{name}: offline, worker draining a full queue", proc, settings, images, sampler))
    report(args, runs, serving, print)


def report(
    args: argparse.Namespace, runs: dict[str, list[Row]], serving: set[int] | None, out: Callable[[str], None]
) -> None:
    where = (
        f"gateway or worker pinned to CPU {','.join(map(str, sorted(serving)))}, clients and RabbitMQ to the others"
        if serving
        else "everything sharing every CPU"
    )
    out(
        f"model {args.model}, batch size {args.batch_size}, {args.images} images, {os.cpu_count()} cores ({where}), "
        f"median of {args.repeat} alternated runs"
    )
    out("| mode | img/s | ratio to online | gateway or worker CPU ms/img | client CPU ms/img | broker CPU ms/img |")
    out("|---|---:|---:|---:|---:|---:|")
    online: dict[str, float] = {}
    for rows in runs.values():
        r = median_row(rows)
        tree, _, mode = r.mode.partition(": ")
        if mode.startswith("online"):
            online[tree] = r.rate
        out(
            f"| {r.mode} | {r.rate:.1f} | {r.rate / online[tree]:.2f} | {r.per_image_ms(r.server_cpu)} "
            f"| {r.per_image_ms(r.client_cpu)} | {r.per_image_ms(r.broker_cpu)} |"
        )


if __name__ == "__main__":
    main()
