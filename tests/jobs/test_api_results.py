"""The API replica's view of results, against the real RabbitMQ: only its own kind, and none lost
across a broker reconnect."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable

import aio_pika
import httpx
import pytest

from service.jobs.messages import DEFAULT_REPLY_TO, JobResult, result_message
from service.jobs.topology import Names
from service.settings import Settings
from tests.conftest import running_gateway
from tests.jobs.conftest import BROKER_URL, broker_ok, publish

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]


async def publish_result(names: Names, result: JobResult, routing_key: str) -> None:
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(names.results)
        await exchange.publish(result_message(result), routing_key)


async def job_state(client: httpx.AsyncClient, job_id: str, want: str, timeout: float = 15) -> None:
    async with asyncio.timeout(timeout):
        while True:
            response = await client.get(f"/jobs/{job_id}")
            if response.status_code == 200 and response.json()["status"] == want:
                return
            await asyncio.sleep(0.05)


async def test_replicas_keep_only_api_results(gateway_factory: MakeSettings, prefix: str) -> None:
    """Results of `gateway ingest` runs (routing key ingest.<run>) never reach an API replica's
    store; the API's own do. Before, every replica stored every result."""
    names = Names(prefix)
    await publish(names)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    async with running_gateway(settings) as client:
        await broker_ok(client)
        await publish_result(names, JobResult(job_id="ingest-1", status="done"), "ingest.run-1")
        await publish_result(names, JobResult(job_id="api-1", status="done"), DEFAULT_REPLY_TO)
        await job_state(client, "api-1", "done")
        assert (await client.get("/jobs/ingest-1")).status_code == 404


def _close_connection(name: str) -> None:
    listed = subprocess.run(
        ["rabbitmqctl", "list_connections", "-q", "pid", "client_properties"], capture_output=True, text=True
    ).stdout
    pids = [line.split("\t", 1)[0] for line in listed.splitlines() if name in line]
    assert pids, listed
    for pid in pids:
        subprocess.run(["rabbitmqctl", "close_connection", pid, "test: simulated network failure"], check=True)


async def test_results_published_during_a_reconnect_are_not_lost(gateway_factory: MakeSettings, prefix: str) -> None:
    """The broker drops the API's connection and a result is published before it reconnects: the
    job still turns done. Before, the replica's exclusive queue died with the connection and the
    job stayed pending for ever."""
    names = Names(prefix)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    async with running_gateway(settings) as client:
        await broker_ok(client)
        await publish_result(names, JobResult(job_id="warm", status="done"), DEFAULT_REPLY_TO)
        await job_state(client, "warm", "done")
        connection_name = f"{prefix}.api."
        await asyncio.to_thread(_close_connection, connection_name)
        await publish_result(names, JobResult(job_id="during", status="done"), DEFAULT_REPLY_TO)
        await job_state(client, "during", "done", timeout=30)
