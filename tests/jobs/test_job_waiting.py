"""``GET /jobs/{id}`` says why a pending job waits, when a worker knows (``waiting``), against a real
gateway, a real worker and the real RabbitMQ."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from service.jobs.assignment import NOT_SERVED_REQUEUES
from service.jobs.worker import run_worker
from service.schemas import JobStatus
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, broker_ok

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
