"""What an ``Idempotency-Key`` costs an offline submit, against a real RabbitMQ: the latency of
``JobsClient.submit`` (publishes, confirms, and the claim's round trip through the stream) without
a key, with a new key, and for a retry of a known key; median and p90 over ``--runs`` submits each,
interleaved so that the broker's noise falls on all three alike.

    python -m loadtests.idempotency_cost --images 1 --runs 300
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aio_pika
import cv2
import numpy as np

from service.jobs.client import JobsClient, OfflineImage
from service.jobs.topology import Names
from service.metrics import Metrics
from service.settings import Settings


async def delete_everything(broker_url: str, names: Names) -> None:
    """The queues and exchanges of the run's prefix (the replica's own results queue expires)."""
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        for queue in (names.work, names.results, names.dead, names.webhooks, names.idempotency):
            await channel.queue_delete(queue)
        for exchange in (names.requests, names.results, names.dead):
            await channel.exchange_delete(exchange)


def png(value: int) -> bytes:
    ok, encoded = cv2.imencode(".png", np.full((16, 16, 3), value, np.uint8))
    assert ok
    return encoded.tobytes()


async def measure(broker_url: str, images: int, runs: int) -> dict[str, list[float]]:
    prefix = f"cost-{uuid.uuid4().hex[:8]}"
    settings = Settings.model_validate({"broker_url": broker_url, "queue_prefix": prefix})
    client = JobsClient(settings, Metrics())
    await client.broker.connect(timeout=30)
    batch = [OfflineImage(png(i % 250), "image/png", f"{i}.png") for i in range(images)]
    ms: dict[str, list[float]] = {"no key": [], "new key": [], "retry of a known key": []}

    async def timed(name: str, key: str | None) -> None:
        start = time.perf_counter()
        await client.submit(batch, 5, key=key)
        ms[name].append((time.perf_counter() - start) * 1000)

    try:
        for _ in range(10):  # warm up: connections, the stream consumer
            await client.submit(batch, 5, key=uuid.uuid4().hex)
        for run in range(runs):
            await timed("no key", None)
            await timed("new key", f"key-{run}")
            await timed("retry of a known key", f"key-{run}")
    finally:
        await client.aclose()
        await delete_everything(broker_url, Names(prefix))
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--images", type=int, default=1, help="images per submit")
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    ms = asyncio.run(measure(args.broker_url, args.images, args.runs))
    print(f"{args.runs} submits of {args.images} image(s) each way, one replica, local RabbitMQ")
    print("| submit | median ms | p90 ms |\n|---|---:|---:|")
    for name, values in ms.items():
        p90 = sorted(values)[int(len(values) * 0.9) - 1]
        print(f"| {name} | {statistics.median(values):.2f} | {p90:.2f} |")


if __name__ == "__main__":
    main()
