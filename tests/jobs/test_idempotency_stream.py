"""The claims stream as an input surface, against the real RabbitMQ: whatever the stream holds or
goes through (hostile entries appended by anyone with broker access, the stream deleted, the
consumer's connection closed), a replica keeps applying later entries and idempotent submits
answer within their timeout, each image queued once."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import pytest

from service.errors import BackendUnavailable, BadRequest
from service.jobs.client import JobsClient, OfflineImage, Submitted
from service.jobs.idempotency import MAX_IMAGES, key_digest
from service.jobs.topology import Names
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import png_bytes, solid_image
from tests.jobs.conftest import BROKER_URL, queue_depth

pytestmark = pytest.mark.rabbitmq

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


def hostile_entries() -> list[bytes]:
    """Entries no replica writes: each is skipped, and none may become a state."""

    def entry(**fields: object) -> bytes:
        base: dict[str, object] = {
            "kind": "intent",
            "key": secrets.token_hex(16),
            "claim": secrets.token_hex(16),
            "fingerprint": secrets.token_hex(16),
            "count": 1,
            "published": 0,
            "at": time.time(),
        }
        return json.dumps({**base, **fields}).encode()

    return [
        b"\xff\xfe not json",
        b"[" * 100_000,
        entry(kind="claim"),  # an unknown kind
        entry(key="zz" * 16),  # not hex
        entry(key=secrets.token_hex(64 * 1024)),  # 128 KiB in one state, counted as 576 bytes
        entry(fingerprint=secrets.token_hex(64 * 1024)),
        entry(claim=secrets.token_hex(64 * 1024)),
        entry(count=0),
        entry(count=10**6),
        entry(kind="outcome", published=1 << 40),  # images beyond its count
        entry(kind="outcome", published=0).replace(b'"published": 0', b'"published": ' + b"9" * 5000),
        entry(at=float("nan")),  # json.dumps writes NaN, which JSON parsers may accept
        entry(at=float("inf")),  # a key that would never expire
        entry(key="ab" * 16, padding="x" * (4 << 20)),  # 4 MiB
    ]


async def test_hostile_entries_are_skipped_and_later_ones_applied(prefix: str) -> None:
    """Whatever bytes are appended to the claims stream (not JSON, deep nesting, unknown kinds,
    digests that are not 32 hex digits or are 128 KiB long, counts and bitmasks out of range,
    NaN and infinite times, a 4 MiB entry), the replica skips each without keeping anything, its
    consumer goes on, and the submits after them are decided and queued once. Before, an entry
    with a 128 KiB key, fingerprint or claim became a state that the byte bound counted as 576
    bytes (200 such entries held 10 MB against 120 KB counted), and an infinite time made a key
    that never expired."""
    names = Names(prefix)
    async with replica(prefix) as client:
        await append(names, hostile_entries())
        submitted = await client.submit(IMAGES, 5, key="after-hostile-entries")
        assert not submitted.replayed
        states = dict(client.idempotency.states.items())
        assert list(states) == [key_digest(b"", "after-hostile-entries")]
        assert (await client.submit(IMAGES, 5, key="after-hostile-entries")).replayed

    async with replica(prefix) as late:  # a replica started afterwards reads them all from the start
        assert (await late.submit(IMAGES, 5, key="after-hostile-entries")).replayed
        assert len(late.idempotency.states) == 1
    assert await queue_depth(names.work) == len(IMAGES)


async def test_an_idempotent_submit_beyond_what_an_entry_counts_is_400(prefix: str) -> None:
    """Where GATEWAY_MAX_IMAGES_PER_REQUEST allows more images than a stream entry counts
    (MAX_IMAGES, so that its bitmask stays a JSON integer every parser reads), an idempotent
    submit of that many is a 400 that queues nothing. Before, building the entry raised a
    ValidationError: a 500."""
    names = Names(prefix)
    async with replica(prefix, max_images_per_request=MAX_IMAGES + 1, max_queue_size=MAX_IMAGES + 1) as client:
        images = [OfflineImage(b"x", "image/png", None)] * (MAX_IMAGES + 1)
        with pytest.raises(BadRequest):
            await client.submit(images, 5, key="too-many")
    assert await queue_depth(names.work) == 0


async def test_a_replica_starts_reading_the_stream_at_its_ttl(prefix: str) -> None:
    """A replica that starts reads the claims written within the TTL, not the expired ones the
    stream still holds (its max-age policy removes whole 500 MB segments only: millions of
    entries). Before, it read the stream from its first entry at every start and reconnect:
    100,000 entries took 30 s here, each idempotent submit 503 meanwhile."""
    names = Names(prefix)
    ttl = 1.0
    async with replica(prefix, idempotency_ttl=ttl) as client:
        old = [client.idempotency.message("outcome", secrets.token_bytes(16), b"c" * 16, b"f" * 16, 1, 1)]
        await append(names, [old[0].body] * 300)
        await read_up_to(client, 299)
    await asyncio.sleep(ttl + 2)  # the condition is time itself: the entries expire (AMQP timestamps are whole seconds)
    late = JobsClient(
        Settings(broker_url=BROKER_URL, queue_prefix=prefix, publish_timeout=PUBLISH_TIMEOUT, idempotency_ttl=ttl),
        Metrics(),
    )
    read: list[bytes] = []
    parse = late.idempotency._read
    late.idempotency._read = lambda body: (read.append(body), parse(body))[1]  # type: ignore[method-assign]
    await late.broker.connect(timeout=30)
    try:
        submitted = await late.submit(IMAGES, 5, key="after-the-old-entries")
        assert not submitted.replayed
    finally:
        await late.aclose()
    assert late.idempotency._offset >= 300  # its intent came after the old entries
    assert not any(body == old[0].body for body in read)
