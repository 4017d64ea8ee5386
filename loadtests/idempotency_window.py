"""How long two API replicas can both take one Idempotency-Key and both publish (the window of
``service.jobs.idempotency``): from the moment replica A starts a submit to the moment replica B
knows A's claim. Against a real RabbitMQ; prints the median and p99 over ``--runs`` submits.

    python -m loadtests.idempotency_window --images 1 --runs 200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import cv2
import numpy as np

from service.jobs.client import JobsClient, OfflineImage
from service.metrics import Metrics
from service.settings import Settings


def png(value: int) -> bytes:
    ok, encoded = cv2.imencode(".png", np.full((16, 16, 3), value, np.uint8))
    assert ok
    return encoded.tobytes()


async def measure(broker_url: str, images: int, runs: int) -> tuple[list[float], list[float]]:
    prefix = f"window-{uuid.uuid4().hex[:8]}"
    settings = Settings.model_validate({"broker_url": broker_url, "queue_prefix": prefix})
    a, b = JobsClient(settings, Metrics()), JobsClient(settings, Metrics())
    await a.broker.connect(timeout=30)
    await b.broker.connect(timeout=30)
    batch = [OfflineImage(png(i % 250), "image/png", f"{i}.png") for i in range(images)]
    submit_ms, window_ms = [], []
    try:
        for run in range(runs):
            key = f"key-{run}"
            start = time.perf_counter()
            await a.submit(batch, 5, ("", key))
            submit_ms.append((time.perf_counter() - start) * 1000)
            while b.idempotency.get("", key) is None:  # noqa: ASYNC110 - polling is what is measured
                await asyncio.sleep(0.0002)
            window_ms.append((time.perf_counter() - start) * 1000)
    finally:
        assert a.broker.channel is not None
        for queue in (settings.queue_prefix + ".idempotency", settings.queue_prefix + ".work"):
            await a.broker.channel.queue_delete(queue)
        await a.aclose()
        await b.aclose()
    return submit_ms, window_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--images", type=int, default=1, help="images per submit")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    submit_ms, window_ms = asyncio.run(measure(args.broker_url, args.images, args.runs))

    def p99(values: list[float]) -> float:
        return sorted(values)[max(0, int(len(values) * 0.99) - 1)]

    print(f"{args.runs} submits of {args.images} image(s), two replicas on one broker")
    print("| | median ms | p99 ms |\n|---|---:|---:|")
    print(f"| submit on replica A (publishes + claim) | {statistics.median(submit_ms):.2f} | {p99(submit_ms):.2f} |")
    print(
        f"| start of A's submit to B knowing the claim (the window) | {statistics.median(window_ms):.2f} | "
        f"{p99(window_ms):.2f} |"
    )


if __name__ == "__main__":
    main()
