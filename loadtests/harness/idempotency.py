"""Remembered ``Idempotency-Key``s, for the idempotency figures and their tests: what one costs an
API replica's memory (``loadtests.idempotency_memory``), and a claims stream filled with entries
for a new replica to read (``loadtests.idempotency_replay``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import tracemalloc

import aio_pika

from service.jobs.idempotency import Entry, IdempotencyLog, fingerprint, key_digest
from service.jobs.topology import Names


def bytes_per_key(keys: int, images: int) -> tuple[float, float]:
    """(measured, counted by the bound) bytes per key."""
    log = IdempotencyLog(Names("memory"), ttl=86400.0, max_bytes=1 << 40, hold=15.0)
    body = fingerprint([(b"image", "image/png", "a.png")] * images, 5).hex()
    entries = []
    for i in range(keys):  # made before measuring: they are the stream's, not the state's
        key, claim = key_digest(b"an api key", f"order-{i:012d}").hex(), secrets.token_hex(16)
        common = {"key": key, "claim": claim, "fingerprint": body, "count": images, "at": 1e10}
        intent = Entry.model_validate({"kind": "intent", **common})
        entries.append((intent, intent.model_copy(update={"kind": "outcome", "published": (1 << images) - 1})))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for intent, outcome in entries:
        log.apply(intent)
        log.apply(outcome)
    measured = (tracemalloc.get_traced_memory()[0] - before) / keys
    tracemalloc.stop()
    assert len(log.states) == keys
    return measured, log.states.currsize / keys


def entry(kind: str, key: str, claim: str, published: int) -> bytes:
    body = {"kind": kind, "key": key, "claim": claim, "fingerprint": "f" * 32, "count": 1}
    return json.dumps({**body, "published": published, "at": time.time()}).encode()


async def fill(broker_url: str, stream: str, entries: int) -> None:
    """``entries`` entries, half intents and half outcomes (``entries // 2`` keys), confirmed."""
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(stream, durable=True, arguments={"x-queue-type": "stream"})
        for start in range(0, entries, 2000):
            bodies = []
            for _ in range(start, min(entries, start + 2000), 2):
                key, claim = secrets.token_hex(16), secrets.token_hex(16)
                bodies += [entry("intent", key, claim, 0), entry("outcome", key, claim, 1)]
            await asyncio.gather(*(channel.default_exchange.publish(aio_pika.Message(body), stream) for body in bodies))
