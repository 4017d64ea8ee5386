"""The claims stream as an input surface, against the real RabbitMQ: whatever the stream holds or
goes through (hostile entries appended by anyone with broker access, the stream deleted, the
consumer's connection closed), a replica keeps applying later entries and idempotent submits
answer within their timeout, each image queued once."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika

from service.errors import BackendUnavailable
from service.jobs.client import JobsClient, OfflineImage, Submitted
from service.jobs.topology import Names
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import png_bytes, solid_image
from tests.jobs.conftest import BROKER_URL, queue_depth

IMAGES = [OfflineImage(png_bytes(solid_image(v, 16)), "image/png", f"{v}.png") for v in (10, 20)]
PUBLISH_TIMEOUT = 0.5


@asynccontextmanager
async def replica(prefix: str, **settings: object) -> AsyncIterator[JobsClient]:
    client = JobsClient(
        Settings(broker_url=BROKER_URL, queue_prefix=prefix, publish_timeout=PUBLISH_TIMEOUT, **settings), Metrics()
    )
    await client.broker.connect(timeout=30)
    try:
        yield client
    finally:
        await client.aclose()


async def append(names: Names, bodies: list[bytes]) -> None:
    """Append raw entries to the claims stream, as anyone with broker access can."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        for body in bodies:
            await channel.default_exchange.publish(aio_pika.Message(body), names.idempotency)


async def read_up_to(client: JobsClient, offset: int) -> None:
    async with asyncio.timeout(15):
        while client.idempotency._offset < offset:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def submit_until_accepted(client: JobsClient, key: str, within: float) -> Submitted:
    """Retry an idempotent submit answered 503, as a client would, for ``within`` seconds."""
    async with asyncio.timeout(within):
        while True:
            try:
                return await client.submit(IMAGES, 5, key=key)
            except BackendUnavailable:
                await asyncio.sleep(0.05)


async def test_a_stream_deleted_and_declared_again_is_followed_from_its_start(prefix: str) -> None:
    """The claims stream is deleted (its consumer is cancelled; the robust channel declares it
    again and consumes it from its start): idempotent submits are accepted again within seconds,
    and a retry replays. Before, the replica skipped every entry of the new stream up to the last
    offset it had read in the old one, so each idempotent submit was 503 (nothing comes back)
    until the new stream had outgrown the old: here 300 entries, one per failed submit."""
    names = Names(prefix)
    async with replica(prefix) as client:
        fillers = [
            client.idempotency.message("outcome", secrets.token_bytes(16), secrets.token_bytes(16), b"f" * 16, 1, 1)
            for _ in range(300)
        ]
        await append(names, [message.body for message in fillers])
        await read_up_to(client, 299)
        connection = await aio_pika.connect(BROKER_URL)
        async with connection:
            await (await connection.channel()).queue_delete(names.idempotency)

        submitted = await submit_until_accepted(client, "after-the-stream-was-deleted", within=15)
        assert not submitted.replayed
        again = await client.submit(IMAGES, 5, key="after-the-stream-was-deleted")
        assert again.replayed
        assert again.job_ids == submitted.job_ids
    assert await queue_depth(names.work) == len(IMAGES)
