"""Job ownership against a real gateway, worker and RabbitMQ: a job's state and result go to the
API key that submitted it; another key gets the 404 of an unknown job, and the key id that
/metrics shows opens nothing."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
from collections.abc import Callable

import httpx
import pytest

from service.jobs.worker import run_worker
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, broker_ok

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
KEY_A, KEY_B = "tenant-a-7c1e5f0d2b9a", "tenant-b-4e8a1c3f6d0b"


def as_key(key: str) -> dict[str, str]:
    return {"x-api-key": key}


async def get_job(client: httpx.AsyncClient, key: str, job_id: str) -> httpx.Response:
    return await client.get(f"/jobs/{job_id}", headers=as_key(key))


def without_ids(response: httpx.Response, job_id: str) -> dict[str, object]:
    """The 404 body with the asked id and the request id taken out: what must not differ between
    another key's job and a job that does not exist."""
    assert response.status_code == 404, response.text
    body = dict(response.json())
    body.pop("request_id", None)
    body["detail"] = str(body["detail"]).replace(job_id, "<id>")
    return body


async def done(client: httpx.AsyncClient, key: str, job_id: str) -> dict[str, object]:
    async with asyncio.timeout(60):
        while (body := (await get_job(client, key, job_id)).json())["status"] == "pending":  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return body  # type: ignore[no-any-return]


async def test_only_the_submitting_key_reads_a_job(gateway_factory: MakeSettings, prefix: str) -> None:
    """Key A submits (plain and idempotent); key B gets the same 404 as for a job that never existed,
    while pending and once done; key A gets the result. Before, any key read any job id."""
    settings = gateway_factory(
        broker_url=BROKER_URL,
        queue_prefix=prefix,
        backend="fake",
        worker_metrics_port=0,
        api_keys=f"{KEY_A} rate=1000,{KEY_B} rate=1000",
    )
    image = [("file", ("a.png", png_bytes(solid_image(42, 16)), "image/png"))]
    stop = asyncio.Event()
    async with running_gateway(settings) as client:
        await broker_ok(client)
        plain = await client.post("/classify?mode=offline", files=image, headers=as_key(KEY_A))
        keyed = await client.post(
            "/classify?mode=offline", files=image, headers={**as_key(KEY_A), "Idempotency-Key": "order-1"}
        )
        jobs = [job["job_id"] for r in (plain, keyed) for job in r.json()["jobs"]]
        unknown = secrets.token_hex(32)
        expected = without_ids(await get_job(client, KEY_B, unknown), unknown)
        for job_id in jobs:
            assert (await get_job(client, KEY_A, job_id)).json()["status"] == "pending"
            assert without_ids(await get_job(client, KEY_B, job_id), job_id) == expected

        worker = asyncio.create_task(run_worker(settings, stop))
        try:
            for job_id in jobs:
                assert (await done(client, KEY_A, job_id))["labels"][0]["index"] == 42  # type: ignore[index]
                assert without_ids(await get_job(client, KEY_B, job_id), job_id) == expected
        finally:
            stop.set()
            await worker

        # B's own submit of the same request under the same idempotency key is its own job
        theirs = await client.post(
            "/classify?mode=offline", files=image, headers={**as_key(KEY_B), "Idempotency-Key": "order-1"}
        )
        assert theirs.status_code == 202
        assert theirs.json()["jobs"][0]["job_id"] != jobs[1]


async def test_the_key_id_on_metrics_opens_nothing(gateway_factory: MakeSettings, prefix: str) -> None:
    """The ids of an idempotent submit cannot be computed from the key id /metrics shows and the
    idempotency key (they are made under the API key itself, service.jobs.owners), and knowing one
    does not let another key read it. Before, they were exactly sha256(key id, key, index)[:32]."""
    settings = gateway_factory(
        broker_url=BROKER_URL, queue_prefix=prefix, backend="fake", api_keys=f"{KEY_A} rate=1000,{KEY_B} rate=1000"
    )
    data = png_bytes(solid_image(7, 16))
    async with running_gateway(settings) as client:
        await broker_ok(client)
        accepted = await client.post(
            "/classify?mode=offline",
            files=[("file", ("0.png", data, "image/png"))],
            headers={**as_key(KEY_A), "Idempotency-Key": "invoice-2024-001"},
        )
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["jobs"][0]["job_id"]
        exposition = (await client.get("/metrics", headers=as_key(KEY_B))).text
        key_ids = set(re.findall(r'gateway_key_images_total\{key="([0-9a-f]+)"\}', exposition))
        assert len(key_ids) == 1
        key_id = key_ids.pop()

        guess = hashlib.sha256(f"{key_id}\0invoice-2024-001\0{0}".encode()).hexdigest()[:32]
        assert job_id != guess
        assert (await get_job(client, KEY_B, guess)).status_code == 404
        assert (await get_job(client, KEY_B, job_id)).status_code == 404
        assert (await get_job(client, KEY_A, job_id)).json()["status"] == "pending"


async def test_a_long_job_id_is_not_echoed_back(gateway_factory: MakeSettings, prefix: str) -> None:
    """A job id of 60,000 characters is a 404 whose detail gives its length, not the id: the answer
    (and any log of it) does not repeat whatever a caller sends, at any size."""
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    async with running_gateway(settings) as client:
        answer = await client.get("/jobs/" + "a" * 60_000)
        short = await client.get("/jobs/" + "b" * 10)
    assert answer.status_code == 404
    assert len(answer.content) < 1_000
    assert "an id of 60000 characters" in answer.json()["detail"]
    assert "'bbbbbbbbbb'" in short.json()["detail"]
