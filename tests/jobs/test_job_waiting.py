"""``GET /jobs/{id}`` says why a pending job waits, when a worker knows (``waiting``), against a real
gateway, a real worker and the real RabbitMQ."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Callable
from pathlib import Path

import aio_pika
import httpx
import pytest

from service.jobs.assignment import NOT_SERVED_REQUEUES
from service.jobs.messages import MODEL_HEADER
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.schemas import JobStatus
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, broker_ok, collect_results, drain, job
from tests.jobs.test_worker_faults import consumed_by_a_worker, publish_only

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
WORKERS_MODELS = """
default = "photos"
[models.photos]
profile = "trivial"
backend = "fake"
"""
API_MODELS = """
default = "fresh"
[models.fresh]
profile = "trivial"
backend = "fake"
[models.photos]
profile = "trivial"
backend = "fake"
"""


async def _status_until(client: httpx.AsyncClient, job_id: str, ready: Callable[[JobStatus], bool]) -> JobStatus:
    async with asyncio.timeout(20):
        while not ready(status := JobStatus.model_validate((await client.get(f"/jobs/{job_id}")).json())):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return status


async def test_a_job_no_worker_serves_says_so_while_pending(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """The API's models file makes ``fresh`` the default before the workers' file knows it (a
    rolling update): a ``/classify`` job goes to ``<prefix>.work`` for ``fresh``, where a worker
    that serves ``photos`` alone requeues it for a worker that does (for about 7 minutes). While it
    is pending, ``GET /jobs/{id}`` says why in ``waiting``, naming the model and what will come of
    it; a job the worker classifies has no ``waiting``. Before, nothing said why for 7 minutes."""
    files = {}
    for name, text in (("api", API_MODELS), ("workers", WORKERS_MODELS)):
        files[name] = tmp_path / f"{name}.toml"
        files[name].write_text(textwrap.dedent(text))
    api = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, models_file=files["api"])
    workers = api.model_copy(update={"models_file": files["workers"], "worker_metrics_port": 0})
    png = {"content-type": "image/png"}
    body = png_bytes(solid_image(3, 8))
    async with running_gateway(api) as client:
        await broker_ok(client)
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(workers, stop))
        try:
            fresh = await client.post("/classify", params={"mode": "offline"}, content=body, headers=png)
            photos = await client.post(
                "/v1/models/photos/classify", params={"mode": "offline"}, content=body, headers=png
            )
            assert [fresh.status_code, photos.status_code] == [202, 202]
            fresh_id, photos_id = (r.json()["jobs"][0]["job_id"] for r in (fresh, photos))
            waiting = await _status_until(client, fresh_id, lambda job: job.waiting is not None)
            done = await _status_until(client, photos_id, lambda job: job.status != "pending")
        finally:
            stop.set()
            await worker
    assert waiting.status == "pending"
    assert waiting.waiting is not None
    assert waiting.waiting.startswith("no worker serves model 'fresh': requeued for one that does (")
    assert (
        f"of {NOT_SERVED_REQUEUES} times, about 7 minutes in all), then it fails as model_not_served" in waiting.waiting
    )
    assert done.status == "done"
    assert done.waiting is None


async def test_a_notice_that_fails_never_costs_the_jobs_in_flight_a_delivery(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """``<prefix>.notices`` deleted under a running worker (by an operator, or a cleanup) while it
    holds a job (the fake backend takes 1 s), then a job for a model nobody serves: its notice
    fails, and that is all: the job in flight is delivered once, and the unserved job stays one copy.
    Before, the notice went out on the consumers' channel, which the broker closed for the missing
    exchange: every job the worker held went back to its queue (the one in flight was delivered
    again, a delivery counted against the delivery limit), and the unserved job ran on as two copies."""
    settings = gateway_factory(
        broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, backend="fake", fake_delay=1.0
    )
    names = Names(prefix)
    unserved = job(4, "unserved")
    assert unserved.headers is not None
    unserved.headers[MODEL_HEADER] = "nobody"
    metrics = Metrics()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, metrics=metrics))
    try:
        await consumed_by_a_worker(names)
        connection = await aio_pika.connect(BROKER_URL)
        async with connection:
            await (await connection.channel()).exchange_delete(names.notices)
        await publish_only(names, job(3, "in-flight"))
        async with asyncio.timeout(20):
            while _events(metrics, "consumed") < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await publish_only(names, unserved)
        async with asyncio.timeout(20):
            while _events(metrics, "results_published") < 1 or _events(metrics, "requeued") < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await worker
    assert [result.job_id for result in await collect_results(names, 1)] == ["in-flight"]
    assert [message.message_id for message in await drain(names.work)] == ["unserved"]
    # every delivery of the unserved job ended in a requeue: one delivery besides them, the job in flight's
    assert _events(metrics, "consumed") == 1 + _events(metrics, "requeued")


def _events(metrics: Metrics, event: str) -> float:
    return metrics.registry.get_sample_value("gateway_queue_messages_total", {"event": event}) or 0.0
