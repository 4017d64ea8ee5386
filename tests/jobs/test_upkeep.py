"""A worker's background duties (``service.jobs.upkeep``) against the real RabbitMQ: the depth of
the queues that fill while nobody reads them is sampled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika
import pytest

from service.backends.fake import FakeBackend
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL, job, publish

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
RUN = "0123456789abcdef"


def _depth(metrics: Metrics, queue: str) -> float | None:
    return metrics.registry.get_sample_value("gateway_queue_depth_messages", {"queue": queue})


async def _until(metrics: Metrics, queue: str, expected: float | None, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while _depth(metrics, queue) != expected:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_the_results_queue_and_ingest_runs_queues_are_sampled(gateway_factory: MakeSettings, prefix: str) -> None:
    """A worker handles one job of an ingest run that nobody reads any more:
    ``gateway_queue_depth_messages`` has ``<prefix>.results`` and ``<prefix>.ingest.<run>`` at 1
    (the job's result, waiting in each). Once the run's queue is gone (its run finished, or it
    expired), its series goes at the next sample. Before, neither queue was sampled."""
    names = Names(prefix)
    ingest = names.ingest_queue(RUN)
    message = job(3, "ingested")
    message.reply_to = f"ingest.{RUN}"
    await publish(names, message)  # declares the topology, then the job
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(ingest, durable=True, arguments={"x-queue-type": "quorum"})
        await queue.bind(names.results, f"ingest.{RUN}")
        settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, backend="fake")
        metrics = Metrics()
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend(), metrics=metrics))
        try:
            await _until(metrics, ingest, 1.0)
            await _until(metrics, names.results, 1.0)
            await queue.delete(if_unused=False, if_empty=False)
            await _until(metrics, ingest, None)
        finally:
            stop.set()
            await worker
