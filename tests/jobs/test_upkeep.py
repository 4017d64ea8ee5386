"""A worker's background duties (``service.jobs.upkeep``) against the real RabbitMQ: the depth of
the queues that fill while nobody reads them is sampled."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aio_pika
import pytest

from service.backends.fake import FakeBackend
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL, gateway_process, job, publish, wait_for_line

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


def _alive(heartbeat: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "alive", "--file", str(heartbeat), "--max-age", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_two_workers_given_one_heartbeat_file_never_vouch_for_each_other(
    prefix: str, models_dir: Path, tmp_path: Path
) -> None:
    """Two real ``gateway worker`` processes on one host with the same settings, so the same
    heartbeat file (docs/routing.md starts two so): the first one's heartbeat is the file's. Stopped
    (SIGSTOP: its loop runs no more), ``gateway alive`` on the file fails, though the second one
    runs on; killed, the second one takes the file over and ``gateway alive`` passes again (a new
    worker started while the old one drains takes over the same way). Before, both touched the
    file, so either one's heartbeat hid the other's stuck loop: the stopped worker passed."""
    heartbeat = tmp_path / "gateway-worker.heartbeat"
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_WORKER_HEARTBEAT_FILE": str(heartbeat),
    }
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            log = tmp_path / f"worker-{i}.log"
            workers.append(gateway_process(["worker"], env, log))
            await asyncio.to_thread(wait_for_line, log, "worker ready")
        first, second = workers
        assert (await asyncio.to_thread(_alive, heartbeat)).returncode == 0
        first.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3.5)
        stuck = await asyncio.to_thread(_alive, heartbeat)
        assert stuck.returncode == 1, "the second worker's heartbeat passed for the stopped one's"
        assert "not alive" in stuck.stderr
        first.kill()
        first.wait(timeout=30)
        async with asyncio.timeout(20):
            while (await asyncio.to_thread(_alive, heartbeat)).returncode != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
        assert second.poll() is None
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=60)
