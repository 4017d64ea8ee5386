"""How long a new API replica takes to read the claims stream, against a real RabbitMQ: fill a
stream with ``--entries`` entries (an intent and an outcome per key, all within the TTL), then
start a replica (``JobsClient``) in a fresh process and time it until it has read them all, with
its resident memory's growth. With ``--baseline DIR`` (a checkout of other code, e.g.
``git archive <commit> | tar -x -C DIR``) the same stream is read by that code too, each in turn,
so that both figures come from one session on the same broker.

    python -m loadtests.idempotency_replay --entries 20000 100000 --runs 2 --baseline /tmp/base

Every queue and exchange it declares is deleted at the end (a run's prefix is ``replay-<hex>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika

BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"


async def delete_everything(broker_url: str, prefix: str) -> None:
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        for queue in ("work", "results", "dead", "webhooks", "idempotency"):
            await channel.queue_delete(f"{prefix}.{queue}")
        for exchange in ("requests", "results", "dead"):
            await channel.exchange_delete(f"{prefix}.{exchange}")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def read_stream(broker_url: str, prefix: str, entries: int) -> dict[str, float]:
    """In the measuring process: a replica from its start until it has read ``entries`` entries
    (and, where the code says so, until it counts itself caught up)."""
    from service.jobs.client import JobsClient
    from service.metrics import Metrics
    from service.settings import Settings

    client = JobsClient(Settings.model_validate({"broker_url": broker_url, "queue_prefix": prefix}), Metrics())
    log = client.idempotency
    before = rss_bytes()
    start = time.perf_counter()
    figures: dict[str, float] = {}
    try:
        await client.broker.connect(timeout=30)
        async with asyncio.timeout(600):
            while log._offset < entries - 1:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            figures["read_s"] = time.perf_counter() - start
            caught_up = getattr(log, "caught_up", None)
            while caught_up is not None and not caught_up():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            figures["ready_s"] = time.perf_counter() - start
        figures["keys"] = len(log.states)
        figures["rss_mb"] = (rss_bytes() - before) / 1e6
    finally:
        await client.aclose()
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await (await connection.channel()).queue_delete(client.listen_queue)
    return figures


def measure(code: Path, prefix: str, entries: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    args = [sys.executable, __file__, "--read", prefix, "--entries", str(entries)]
    done = subprocess.run(args, env=env, cwd=code, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reading with {code} failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", default=BROKER_URL)
    parser.add_argument("--entries", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--runs", type=int, default=1, help="replicas started per stream and code (median)")
    parser.add_argument("--baseline", type=Path, help="a checkout of the code to compare with")
    parser.add_argument("--read", help=argparse.SUPPRESS)  # the measuring process: this prefix
    args = parser.parse_args()
    if args.read:
        print(json.dumps(asyncio.run(read_stream(args.broker_url, args.read, args.entries[0]))))
        return
    # here, not at the top: the measuring process runs this file with the measured checkout on its
    # path, whose loadtests may have no harness module for it
    from loadtests.harness.idempotency import fill

    codes = {"this checkout": Path.cwd()} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    print(f"{'entries':>8} {'code':>14} {'read s':>8} {'ready s':>8} {'entries/s':>10} {'+RSS MB':>8}")
    for entries in args.entries:
        prefix = f"replay-{uuid.uuid4().hex[:8]}"
        try:
            asyncio.run(fill(args.broker_url, f"{prefix}.idempotency", entries))
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
            for _ in range(args.runs):  # interleaved: the broker's noise falls on both alike
                for name, code in codes.items():
                    runs[name].append(measure(code, prefix, entries))
            for name, figures in runs.items():
                read = statistics.median(f["read_s"] for f in figures)
                ready = statistics.median(f["ready_s"] for f in figures)
                rss = statistics.median(f["rss_mb"] for f in figures)
                print(f"{entries:>8} {name:>14} {read:>8.2f} {ready:>8.2f} {entries / read:>10,.0f} {rss:>8.1f}")
        finally:
            asyncio.run(delete_everything(args.broker_url, prefix))


if __name__ == "__main__":
    main()
