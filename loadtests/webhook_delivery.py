"""What completion webhooks cost and how late they arrive: one ``WebhookSender`` (as in a worker)
against a loopback receiver, through a real RabbitMQ. Publishes ``--jobs`` deliveries at once, as
finished jobs would be, and prints deliveries/s and the delay from a job's end to its accepted
delivery (median, p99). With ``--fail-first`` the receiver refuses each first attempt (503), so
every delivery also takes the retry path (a TTL queue and its dead-lettering back).

    python -m loadtests.webhook_delivery --jobs 2000
    python -m loadtests.webhook_delivery --jobs 2000 --fail-first --delay 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import time
import uuid

import aio_pika
from aiohttp import web

from service.jobs.broker import Broker
from service.jobs.messages import JobResult
from service.jobs.topology import Names
from service.jobs.webhooks import WebhookSender, delivery_message
from service.metrics import Metrics
from service.schemas import Label, ModelInfo
from service.settings import Settings


async def measure(broker_url: str, jobs: int, fail_first: bool, delay: float, concurrency: int) -> dict[str, float]:
    seen: set[str] = set()
    accepted: dict[str, float] = {}
    done = asyncio.Event()

    async def receive(request: web.Request) -> web.Response:
        await request.read()
        webhook_id = request.headers["webhook-id"]
        if fail_first and webhook_id not in seen:
            seen.add(webhook_id)
            return web.Response(status=503)
        accepted.setdefault(webhook_id, time.time())
        if len(accepted) == jobs:
            done.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    prefix = f"webhook-bench-{uuid.uuid4().hex[:8]}"
    settings = Settings.model_validate(
        {
            "broker_url": broker_url,
            "queue_prefix": prefix,
            "webhook_secret": "whsec_" + base64.b64encode(os.urandom(32)).decode(),
            "webhook_allow_http": True,
            "webhook_allowlist": "127.0.0.1/32",
            "webhook_retry_delays": str(delay),
            "webhook_concurrency": concurrency,
        }
    )
    names = Names(prefix)
    broker = Broker(broker_url, names)
    await broker.connect(timeout=30)
    sender = WebhookSender(settings, broker, Metrics())
    labels = [Label(index=i, label=f"class {i}", score=0.2) for i in range(5)]
    try:
        await sender.start()
        ended: dict[str, float] = {}
        start = time.perf_counter()
        for i in range(jobs):
            result = JobResult(
                job_id=f"job-{i}", status="done", labels=labels, model=ModelInfo(name="trivial", version="1")
            )
            message = delivery_message(result, url)
            ended[result.job_id] = time.time()
            await broker.publish("queue", message, names.webhooks)
        await asyncio.wait_for(done.wait(), timeout=600)
        elapsed = time.perf_counter() - start
    finally:
        await sender.stop(drain_timeout=5)
        assert broker.channel is not None
        channel: aio_pika.abc.AbstractChannel = broker.channel
        for queue in (names.webhooks, *(names.webhook_retry(d) for d in settings.webhook_retry_delays_ms)):
            await channel.queue_delete(queue)
        for queue in (names.work, names.results, names.dead):
            await channel.queue_delete(queue)
        for exchange in (names.requests, names.results, names.dead):
            await channel.exchange_delete(exchange)
        await broker.aclose()
        await runner.cleanup()
    delays = sorted((accepted[j] - ended[j]) * 1000 for j in ended)
    return {
        "deliveries_per_s": jobs / elapsed,
        "p50_ms": statistics.median(delays),
        "p99_ms": delays[min(len(delays) - 1, int(len(delays) * 0.99))],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--fail-first", action="store_true", help="the receiver refuses every first attempt")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds before a retry (with --fail-first)")
    parser.add_argument("--concurrency", type=int, default=32, help="GATEWAY_WEBHOOK_CONCURRENCY")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    runs = [
        asyncio.run(measure(args.broker_url, args.jobs, args.fail_first, args.delay, args.concurrency))
        for _ in range(args.repeat)
    ]
    path = "first attempt refused, then retried" if args.fail_first else "accepted at the first attempt"
    print(f"{args.jobs} webhooks, {path}, concurrency {args.concurrency}, {args.repeat} run(s), medians:")
    for key in ("deliveries_per_s", "p50_ms", "p99_ms"):
        print(f"  {key:18} {statistics.median(run[key] for run in runs):10.1f}")


if __name__ == "__main__":
    main()
