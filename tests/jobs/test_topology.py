"""The gateway's exchanges and queues as it declares them (``service.jobs.topology``), against the
real RabbitMQ: the queues that would grow without bound carry their bounds as arguments, and queues
an earlier version declared without them are used as they are."""

from __future__ import annotations

import asyncio
import logging
import subprocess

import aio_pika
import pytest

from service.jobs.policies import gateway_policies, rabbitmqctl_commands
from service.jobs.topology import Names, declare, declare_replicated, ingest_arguments, queue_exists
from tests.jobs.conftest import BROKER_URL

pytestmark = pytest.mark.rabbitmq


async def _arguments(queue: str) -> str:
    """The queue's arguments as the broker lists them."""
    listed = await asyncio.to_thread(
        subprocess.run, ["rabbitmqctl", "list_queues", "-q", "name", "arguments"], capture_output=True, text=True
    )
    rows = dict(line.split("\t", 1) for line in listed.stdout.splitlines() if "\t" in line)
    return rows[queue]


async def test_the_results_queue_and_an_ingest_runs_queue_carry_their_bounds(prefix: str) -> None:
    """``<prefix>.results`` is declared capped (``x-max-length`` 1,000,000, ``x-overflow``
    ``drop-head``) and an ingest run's queue expiring (``x-expires``): bounded without ``gateway
    queues policies``, which the quick start never applies. Before, the results queue's cap was a
    policy only, and an ingest run's queue had no bound at all."""
    names = Names(prefix)
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        await declare(connection, channel, names)
        await declare_replicated(connection, channel, names.ingest_queue("0" * 16), ingest_arguments(7 * 86400))
    results = await _arguments(names.results)
    assert '{"x-max-length",1000000}' in results
    assert '{"x-overflow","drop-head"}' in results
    assert '{"x-expires",604800000}' in await _arguments(names.ingest_queue("0" * 16))


async def test_queues_an_earlier_version_declared_are_used_as_they_are(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A results queue (quorum, without the cap) and an ingest run's queue (without the expiry), as
    an earlier version declared them: declaring the topology and resuming the run use them as they
    are, saying what they lack (RabbitMQ refuses a declaration whose arguments differ with
    PRECONDITION_FAILED, which closes the channel), and the channel stays usable."""
    names = Names(prefix)
    ingest = names.ingest_queue("1" * 16)
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        old = await connection.channel()
        for queue in (names.results, ingest):
            await old.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        channel = await connection.channel()
        with caplog.at_level(logging.WARNING, logger="service.jobs.topology"):
            topology = await declare(connection, channel, names)
            resumed = await declare_replicated(connection, channel, ingest, ingest_arguments(60))
        await topology.results_exchange.publish(aio_pika.Message(b"{}"), "anything")
        assert not channel.is_closed
        assert resumed.name == ingest
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert f"queue {names.results} exists without x-max-length=1000000, x-overflow=drop-head" in warned
    assert f"queue {ingest} exists without x-expires=60000" in warned
    assert "x-max-length" not in await _arguments(names.results)


async def test_the_ingest_policy_bounds_the_queues_of_earlier_versions(prefix: str) -> None:
    """An ingest run's queue an earlier version declared without ``x-expires``, its run never
    rerun: ``gateway queues policies``' ``<prefix>-ingest`` policy applies to it, and the broker
    deletes it once unused for the policy's ``expires`` (2 s here), as it would a new one."""
    names = Names(prefix)
    ingest = names.ingest_queue("2" * 16)
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(ingest, durable=True, arguments={"x-queue-type": "quorum"})
    policies = gateway_policies(names, 3, ingest_ttl=2)
    try:
        for command in rabbitmqctl_commands(policies):
            await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
        async with asyncio.timeout(30):
            while await _exists(ingest):  # noqa: ASYNC110
                await asyncio.sleep(0.2)
    finally:
        for policy in policies:
            await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "clear_policy", policy.name], capture_output=True)


async def _exists(queue: str) -> bool:
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        return await queue_exists(connection, queue)
