"""Idempotent offline submits: ``Idempotency-Key`` on ``POST /classify?mode=offline``.

* **Job ids are derived, not drawn**: image i of a submit with key K under API key S gets
  ``sha256(S, K, i)``. Any replica, with or without history, gives a retry the same ids, so a
  duplicate that slips through (see the window below) is the same job twice, never two jobs.
* **Claims are shared through RabbitMQ**: after a submit, the replica appends a claim (scope, key,
  a fingerprint of the body, which images were confirmed published) to a stream queue,
  ``<prefix>.idempotency``. Every API replica reads that stream from its start when it connects, and
  follows it, keeping the claims younger than ``GATEWAY_IDEMPOTENCY_TTL`` in memory; the
  ``<prefix>-idempotency`` policy (``max-age``) lets RabbitMQ drop older segments.
* A retry whose claim is known publishes nothing new (only the images an earlier, partly failed
  attempt did not get confirmed) and returns the same job ids; the same key with another body is
  409. On one replica, submits with the same key run one at a time.
* **The window**: two replicas that take the same key within the time a claim takes to reach the
  other (a submit's publish time plus the stream's delivery, milliseconds) both publish; the jobs
  keep their ids, so a client sees one set of ids, and each job is classified twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from weakref import WeakValueDictionary

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel
from cachetools import TTLCache
from pydantic import BaseModel, ValidationError

from service.jobs.topology import Names

logger = logging.getLogger(__name__)

MAX_CLAIMS = 1_000_000
"""Claims held in memory at most (~300 bytes each), whatever the TTL."""


class Claim(BaseModel):
    scope: str
    """The API key's id ("" without keys): two tenants' keys never collide."""
    key: str
    fingerprint: str
    job_ids: list[str]
    published: list[int]
    """Indices of the images whose publish the broker confirmed."""
    at: float
    """When it was made (epoch seconds): replayed claims older than the TTL are skipped."""


def job_ids(scope: str, key: str, count: int) -> list[str]:
    return [hashlib.sha256(f"{scope}\0{key}\0{i}".encode()).hexdigest()[:32] for i in range(count)]


def fingerprint(images: Sequence[tuple[bytes, str, str | None]], top_k: int, webhook: str | None = None) -> str:
    """Of what a submit asks for: each image's bytes, type and filename, in order, ``top_k`` and
    the webhook URL (when there is one: a submit without keeps the fingerprint of earlier versions)."""
    digest = hashlib.sha256(f"top_k={top_k};n={len(images)}".encode())
    if webhook is not None:
        digest.update(f"webhook={webhook}\0".encode())
    for data, content_type, filename in images:
        digest.update(hashlib.sha256(data).digest())
        digest.update(f"\0{content_type}\0{filename or ''}\0".encode())
    return digest.hexdigest()


class IdempotencyLog:
    def __init__(self, names: Names, ttl: float) -> None:
        self.stream = names.idempotency
        self.ttl = ttl
        self.claims: TTLCache[tuple[str, str], Claim] = TTLCache(maxsize=MAX_CLAIMS, ttl=ttl)
        self._locks: WeakValueDictionary[tuple[str, str], asyncio.Lock] = WeakValueDictionary()
        self._channel: AbstractRobustChannel | None = None

    def lock(self, scope: str, key: str) -> asyncio.Lock:
        """Held while a submit with this key publishes, so a concurrent retry on this replica sees
        its claim instead of publishing again."""
        lock = self._locks.get((scope, key))
        if lock is None:
            lock = self._locks[(scope, key)] = asyncio.Lock()
        return lock

    async def follow(self, channel: AbstractRobustChannel) -> None:
        """Declare the stream and read it from its start, then as it grows (on a channel of its
        own: a stream consumer needs a prefetch and acks)."""
        await channel.set_qos(prefetch_count=1000)
        queue = await channel.declare_queue(self.stream, durable=True, arguments={"x-queue-type": "stream"})
        await queue.consume(self._on_claim, arguments={"x-stream-offset": "first"})
        self._channel = channel

    async def _on_claim(self, message: AbstractIncomingMessage) -> None:
        try:
            claim = Claim.model_validate_json(message.body)
        except ValidationError as exc:
            logger.warning("jobs: ignoring a malformed idempotency claim: %s", exc)
        else:
            if time.time() - claim.at < self.ttl:
                self._merge(claim)
        await message.ack()

    def _merge(self, claim: Claim) -> None:
        known = self.claims.get((claim.scope, claim.key))
        if known is not None and known.fingerprint == claim.fingerprint:
            claim = claim.model_copy(update={"published": sorted({*known.published, *claim.published}), "at": known.at})
        elif known is not None and known.at <= claim.at:  # two bodies raced under one key: the first wins
            return
        self.claims[(claim.scope, claim.key)] = claim

    def get(self, scope: str, key: str) -> Claim | None:
        return self.claims.get((scope, key))

    def remember(self, claim: Claim) -> aio_pika.Message:
        """Keep the claim here at once, and return the message that shares it with other replicas."""
        self._merge(claim)
        return aio_pika.Message(
            claim.model_dump_json().encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
