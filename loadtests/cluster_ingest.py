"""Ingest throughput on one RabbitMQ node against a three-node cluster, and the pause when a node dies.

Quorum queues replicate every message on three nodes before confirming it: that costs something.
Each row runs ``gateway ingest`` over the same small PNGs through two ``gateway worker`` processes
with the fake backend (no model time: the broker path is what is measured), alternating the two
targets ``--repeat`` times and showing the median rate of each:

* one node: the machine's RabbitMQ (``--broker``, default 127.0.0.1:5672);
* three nodes: a cluster started on this machine (``loadtests.harness.rabbitmq_cluster``), every
  client given every node.

Then one more ingest on the cluster, with the node holding the work queue's leader SIGKILLed when a
third of the results are in: the longest time without a new result after the kill, and whether
every image still ended done once. The ingest resends what has had no result after 20 s of silence:
a wait that long means results were lost in flight and recovered by that resend.

    python -m loadtests.cluster_ingest --images 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np

from loadtests.harness.rabbitmq_cluster import RabbitCluster

ROOT = Path(__file__).resolve().parents[1]


def write_pngs(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = np.full((8, 8, 3), i % 251, dtype=np.uint8)
        cv2.imwrite(str(folder / f"{i:06d}.png"), pixels)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_ingest(
    broker_url: str,
    images: Path,
    work: Path,
    during: Callable[[subprocess.Popen[str], Path, str], None] | None = None,
) -> tuple[float, int]:
    """Two workers and one ingest under a fresh queue prefix; returns (seconds, results written).
    The prefix's queues are deleted afterwards on the machine's own broker."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": broker_url,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_MAX_BATCH_SIZE": "32",
        "GATEWAY_MODELS_DIR": str(work / "models"),
    }
    workers = []
    try:
        for i in range(2):
            log = (work / f"worker-{i}.log").open("w")
            workers.append(
                subprocess.Popen([sys.executable, "-m", "service", "worker"], env=env, stdout=log, stderr=log, cwd=ROOT)
            )
        deadline = time.monotonic() + 120
        while sum("worker ready" in (work / f"worker-{i}.log").read_text() for i in range(2)) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not start")
            time.sleep(0.1)
        out = work / f"out-{uuid.uuid4().hex[:6]}.jsonl"
        started = time.monotonic()
        ingest = subprocess.Popen(
            [sys.executable, "-m", "service", "ingest", str(images), "--out", str(out), "--resend-after", "20"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        if during is not None:
            during(ingest, out, prefix)
        _, stderr = ingest.communicate(timeout=900)
        if ingest.returncode != 0:
            raise RuntimeError(f"ingest failed: {stderr[-2000:]}")
        return time.monotonic() - started, lines(out)
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=60)
        listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name"], capture_output=True, text=True)
        for queue in listed.stdout.split():
            if queue.startswith(prefix + "."):
                subprocess.run(["rabbitmqctl", "delete_queue", queue], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/", help="the one-node broker")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RabbitCluster(size=3) as cluster:
        work = Path(tmp)
        images = work / "images"
        write_pngs(images, args.images)
        rates: dict[str, list[float]] = {"one node": [], "three nodes": []}
        for _ in range(args.repeat):
            for target, url in (("one node", args.broker), ("three nodes", cluster.urls)):
                seconds, written = run_ingest(url, images, work)
                if written != args.images:
                    raise RuntimeError(f"{target}: {written} results for {args.images} images")
                rates[target].append(written / seconds)

        stall = 0.0
        before_kill = 0

        def kill_the_leader(ingest: subprocess.Popen[str], out: Path, prefix: str) -> None:
            nonlocal stall, before_kill
            node = cluster.nodes[0]  # asked first: rabbitmqctl takes a second or two
            rows = json.loads(cluster.ctl(node, "list_queues", "name", "leader", "--formatter", "json"))
            leader = next(r["leader"] for r in rows if r["name"] == f"{prefix}.work")
            while lines(out) < 5 * args.images // 3 and ingest.poll() is None:
                time.sleep(0.01)
            cluster.kill(next(n for n in cluster.nodes if n.name == leader))
            before_kill = seen = lines(out)
            last = time.monotonic()
            while ingest.poll() is None:
                now, count = time.monotonic(), lines(out)
                if count > seen:
                    stall, seen, last = max(stall, now - last), count, now
                time.sleep(0.005)

        kill_images = work / "kill-images"  # more of them: the kill must come mid-run
        write_pngs(kill_images, 5 * args.images)
        kill_images_count = 5 * args.images
        seconds, written = run_ingest(cluster.urls, kill_images, work, kill_the_leader)
        if written != kill_images_count:
            raise RuntimeError(f"{written} results for {kill_images_count} images after the kill")

    print(f"ingest of {args.images} small PNGs, 2 workers, fake backend, {args.repeat} runs each (median)")
    print("| broker | img/s (median) | runs |")
    print("|---|---|---|")
    for target, values in rates.items():
        print(f"| {target} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    ratio = statistics.median(rates["three nodes"]) / statistics.median(rates["one node"])
    print(f"three nodes against one: {ratio:.2f}x")
    print(
        f"leader's node SIGKILLed after {before_kill} of {written} results: every image done once; "
        f"longest wait for a result after the kill {stall:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
