"""Images at the edges of geometry through a real worker (``tests/http/test_edge_geometry.py`` has
them through ``/classify`` on every backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from service.jobs.worker import run_worker
from service.settings import Settings
from tests.conftest import running_gateway
from tests.http.test_edge_geometry import IMAGES, classify, is_clear_400
from tests.jobs.conftest import BROKER_URL, broker_ok

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]


async def test_edge_geometries_through_a_worker(gateway_factory: MakeSettings, prefix: str) -> None:
    """The same images submitted offline: a side over the decoder's is refused at submit with the
    same 400 (it used to pass validation and fail in the worker); every other one is classified
    by a real worker (ONNX Runtime), its job done with labels."""
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    try:
        async with running_gateway(settings) as client:
            await broker_ok(client)
            jobs: dict[str, str] = {}
            for name, fmt, data, must_refuse in IMAGES:
                answer = await classify(client, fmt, data, mode="offline")
                if must_refuse:
                    is_clear_400(answer, name)
                else:
                    assert answer.status_code == 202, (name, answer.text)
                    jobs[name] = answer.json()["jobs"][0]["job_id"]
            async with asyncio.timeout(120):
                for name, job_id in jobs.items():
                    while (status := (await client.get(f"/jobs/{job_id}")).json())["status"] == "pending":  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    assert status["status"] == "done", (name, status)
                    assert len(status["labels"]) == 5, name
    finally:
        stop.set()
        await worker
