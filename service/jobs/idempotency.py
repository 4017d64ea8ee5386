"""Idempotent offline submits: ``Idempotency-Key`` on ``POST /classify?mode=offline``.

* **Job ids are derived, not drawn** (``service.jobs.owners``): from the API key's secret, the
  idempotency key, the request's fingerprint and the image's index. A retry of the same request
  gets the same ids on any replica; the same key with another body after its TTL gets new ones.
* **The stream is the order.** Replicas share claims through a stream queue,
  ``<prefix>.idempotency``, which each reads from its last TTL when it connects and then follows
  (not ready until it has read it up to its end: a marker it appends when it subscribes).
  Before publishing anything, a submit appends an *intent* (which key, which request, a random
  claim id) and waits until its own replica has read the stream up to that intent. Every replica
  applies the same entries in the same order with the same rule (``IdempotencyLog.apply``), so all
  agree on the one intent that may publish: the first for its key, while no earlier one holds it.
  That one publishes the images not confirmed yet and appends an *outcome* (which images the broker
  confirmed), which releases the key. An intent that finds the key held waits for the outcome and
  then answers from it (the same ids, nothing published) or, if images are still missing, claims
  again. The same key with another request is 409.
* **A holder that dies** (crash, lost connection) before its outcome holds the key for
  ``HOLD_TIMEOUTS`` x ``GATEWAY_PUBLISH_TIMEOUT`` after its intent; then the next intent takes over
  and publishes what no outcome confirmed (images the dead one published unconfirmed are then queued
  twice, under the same ids).
* **Without the stream** (broker down, the intent not read back within the publish timeout) an
  idempotent submit is 503 and publishes nothing.
* **Memory**: per key, a fixed-size state (key and fingerprint digests, the image count, the
  confirmed images as a bitmask, the holder), bounded in bytes by ``GATEWAY_IDEMPOTENCY_MAX_BYTES``
  and in age by ``GATEWAY_IDEMPOTENCY_TTL``; over the bytes, the least recently used keys are
  forgotten early (a retry of one is then queued again, under the same ids).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal
from weakref import WeakValueDictionary

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustConnection
from cachetools import TLRUCache
from pydantic import BaseModel, Field, ValidationError, model_validator

from service.errors import BackendUnavailable
from service.jobs.topology import Names

logger = logging.getLogger(__name__)

HOLD_TIMEOUTS = 3
"""An intent holds its key for this many publish timeouts at most: its images' publishes and its
outcome's each take one at most."""
STATE_BYTES = 576
"""What a key's state costs in memory besides its bitmask (the state, its digests, the cache's
entry): measured with ``python -m loadtests.idempotency_memory``."""
DIGEST_BYTES = 16
MAX_IMAGES = 1 << 13
"""Most images an entry may count: its bitmask, written in decimal, stays within the 4,300 digits
that a JSON integer may have (a larger one is refused as out of range)."""
MAX_ENTRY_BYTES = 4096
"""Longest entry a replica reads (one of ``MAX_IMAGES`` images is about 2.8 KB): anything longer in
the stream was not written by a replica, and is skipped unparsed."""
HEX_DIGEST = rf"^[0-9a-f]{{{2 * DIGEST_BYTES}}}$"
PREFETCH = 1000
"""Stream entries delivered ahead of their acks."""
ACK_EVERY = 200
"""Entries read between two acks (``multiple``: one frame for all of them), well within the
prefetch window, so the broker never stops delivering for want of an ack."""
ACK_DELAY = 0.05
"""Seconds the last entries read wait for an ack when fewer than ``ACK_EVERY`` follow."""


class BatchAcks:
    """Acks a stream consumer's entries with ``multiple=True``: one frame per ``ACK_EVERY`` entries
    or ``ACK_DELAY`` seconds, whichever comes first. Entries are applied in delivery order, each
    finished when its callback returns, so acking the last one read settles every one before it.
    (``service.jobs.acks.Acks`` is for messages finished out of order: its bookkeeping per delivery
    buys nothing here.) One task sends the acks, one at a time: a later ``multiple`` ack never
    leaves before an earlier one. After a reconnect the old channel's entries cannot be acked (the
    ack fails, and is dropped): the broker delivers the stream again anyway."""

    def __init__(self) -> None:
        self._last: AbstractIncomingMessage | None = None
        self._count = 0
        self._unacked = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.frames = 0
        """Ack frames sent, for tests and the curious."""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="idempotency-acks")

    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        return () if self._task is None else (self._task,)

    def read(self, message: AbstractIncomingMessage) -> None:
        self._last = message
        self._count += 1
        self._unacked.set()
        if self._count >= ACK_EVERY:
            self._full.set()

    async def _run(self) -> None:
        while True:
            await self._unacked.wait()
            with suppress(TimeoutError):
                async with asyncio.timeout(ACK_DELAY):
                    await self._full.wait()
            self._unacked.clear()
            self._full.clear()
            message, self._last, self._count = self._last, None, 0
            if message is None:
                continue
            try:
                await message.ack(multiple=True)
                self.frames += 1
            except (aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                logger.debug("jobs: cannot ack on a lost channel (%s); the stream is read again", exc)


class Entry(BaseModel):
    """One entry of the claims stream. Every field is bounded: an entry is read from a stream
    anyone with broker access can append to, and what it holds stays in memory."""

    kind: Literal["intent", "outcome"]
    key: str = Field(pattern=HEX_DIGEST)
    """Hex digest of the API key and the idempotency key (``key_digest``): never the key itself."""
    claim: str = Field(pattern=HEX_DIGEST)
    """Hex id of the attempt; an outcome names the intent it settles."""
    fingerprint: str = Field(pattern=HEX_DIGEST)
    count: int = Field(ge=1, le=MAX_IMAGES)
    published: int = Field(0, ge=0)
    """Outcome: bit i set when the broker confirmed image i (i < ``count``)."""
    at: float = Field(allow_inf_nan=False)
    """Wall-clock time of the entry (epoch seconds)."""

    @model_validator(mode="after")
    def _within_count(self) -> Entry:
        if self.published >> self.count:
            raise ValueError(f"published has bits beyond the {self.count} images")
        return self


@dataclass(frozen=True, slots=True)
class KeyState:
    fingerprint: bytes
    count: int
    published: int
    """Bit i set once the broker confirmed image i."""
    holder: bytes | None
    """The claim id of the intent now publishing, if any."""
    since: float
    """When the holder's intent was made."""
    at: float
    """When the key was first claimed: its TTL runs from here."""

    @property
    def complete(self) -> bool:
        return self.published == (1 << self.count) - 1


Verdict = Literal["publish", "wait", "replay", "conflict"]


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    published: int = 0
    """The images confirmed before this intent (bitmask)."""
    until: float = 0.0
    """``wait``: when the holder's hold ends (epoch seconds)."""


def key_digest(owner: bytes, key: str) -> bytes:
    return hmac.new(owner, b"gateway-idempotency-key\0" + key.encode(), hashlib.sha256).digest()[:DIGEST_BYTES]


def fingerprint(
    images: Sequence[tuple[bytes, str, str | None]], top_k: int, webhook: str | None = None, target: str = ""
) -> bytes:
    """Of everything a submit queues: each image's bytes, type and filename, in order, their
    count, ``top_k``, the webhook URL and the ``target`` (the model and version the jobs name; ""
    for the default model at a version its workers pick, which is what every submit of earlier
    versions was, so their keys replay as before)."""
    digest = hashlib.sha256(f"gateway-submit-v2\0top_k={top_k}\0n={len(images)}\0".encode())
    digest.update(f"webhook={webhook}\0".encode() if webhook is not None else b"no-webhook\0")
    if target:
        digest.update(f"target={target}\0".encode())
    for data, content_type, filename in images:
        digest.update(hashlib.sha256(data).digest())
        digest.update(f"\0{content_type}\0{filename is not None}{filename or ''}\0".encode())
    return digest.digest()[:DIGEST_BYTES]


def _state_bytes(state: KeyState) -> int:
    return STATE_BYTES + sys.getsizeof(state.published)


class IdempotencyLog:
    def __init__(self, names: Names, ttl: float, max_bytes: int, hold: float) -> None:
        self.stream = names.idempotency
        self.ttl = ttl
        self.hold = hold
        self.states: TLRUCache[bytes, KeyState] = TLRUCache(
            maxsize=max_bytes, ttu=lambda _key, state, _now: state.at + ttl, timer=time.time, getsizeof=_state_bytes
        )
        self._decisions: dict[bytes, asyncio.Future[Decision]] = {}
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = {}
        self._locks: WeakValueDictionary[bytes, asyncio.Lock] = WeakValueDictionary()
        self._offset = -1
        """The last stream offset read: a lower one means the stream is read from its start again."""
        self._channel: AbstractRobustChannel | None = None
        self._acks = BatchAcks()
        self._marker: str | None = None
        """Hex id of the marker to read before this replica has caught up (None: none awaited)."""
        self._marking: set[asyncio.Task[None]] = set()
        self._caught_up: float | None = None
        """Monotonic time this replica read its last marker; None while it is behind."""
        self._behind_since = time.monotonic()
        self._read_behind = 0
        """Entries read since it is behind."""

    def lock(self, key: bytes) -> asyncio.Lock:
        """Held while a submit with this key runs on this replica: a concurrent retry here waits
        for it and then replays, without a round trip through the stream."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def follow(self, connection: AbstractRobustConnection) -> None:
        """Declare the stream and read it from its entries of the last TTL, then as it grows (on a
        channel of its own: a stream consumer needs a prefetch and acks). RabbitMQ starts the
        consumer at the first chunk written at or after that time (``x-stream-offset`` as a
        timestamp): the entries before it are expired, and the stream's ``max-age`` policy only
        removes whole segments (500 MB by default), so reading from ``first`` read every expired
        entry still there at each start and reconnect. The replica is behind (``behind``: not
        ready) until it has read the marker it appends once it consumes, and again after each
        reconnect until it has read the one it appends then."""
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.declare_queue(self.stream, durable=True, arguments={"x-queue-type": "stream"})
        self._channel = channel
        self._acks.start()
        since = datetime.fromtimestamp(time.time() - self.ttl, tz=UTC)
        self._catch_up()
        await queue.consume(self._on_entry, arguments={"x-stream-offset": since})
        connection.reconnect_callbacks.add(self._on_reconnect)

    def _on_reconnect(self, _connection: object) -> None:
        """The robust channel consumes the stream again from its start: behind until the marker
        appended now is read (one appended before the connection was lost proves nothing)."""
        self._catch_up()

    def _catch_up(self) -> None:
        """Behind from now until a new marker, appended now, is read back."""
        if self._caught_up is not None:
            self._caught_up = None
            self._read_behind, self._behind_since = 0, time.monotonic()
        self._marker = secrets.token_bytes(DIGEST_BYTES).hex()
        task = asyncio.create_task(self._append_marker(self._marker), name="idempotency-marker")
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    async def _append_marker(self, marker: str) -> None:
        """A marker is an outcome of nothing for no key: a no-op for every replica, earlier
        versions included. Appended until confirmed, while it is the one awaited."""
        assert self._channel is not None
        zero = bytes(DIGEST_BYTES)
        message = self.message("outcome", zero, bytes.fromhex(marker), zero, 1)
        while self._marker == marker:
            try:
                await self._channel.default_exchange.publish(message, self.stream, timeout=10)
                return
            except (TimeoutError, aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                logger.info(
                    "jobs: marker not appended to the idempotency stream yet (%s); retrying", type(exc).__name__
                )
                await asyncio.sleep(1.0)

    def behind(self) -> str | None:
        """Why this replica has not read the stream up to its (re)subscription yet; None once it has."""
        if self._caught_up is not None:
            return None
        seconds = time.monotonic() - self._behind_since
        read = f"{self._read_behind:,} entries in {seconds:.1f} s"
        return f"reading the claims stream: {read}, not at its end yet"  # (its name: not for clients)

    def caught_up(self) -> bool:
        return self._caught_up is not None

    async def _on_entry(self, message: AbstractIncomingMessage) -> None:
        offset = (message.headers or {}).get("x-stream-offset")
        if isinstance(offset, int):
            if offset <= self._offset:
                self._restart()
            self._offset = offset
        self._read_behind += 1
        self._read(message.body)
        self._acks.read(message)

    def _restart(self) -> None:
        """The stream is read from its start again: the consumer was restored after a reconnect
        (the same entries follow), or the stream was deleted and declared again (its offsets begin
        at 0, and what the old one held is gone for every replica). Either way the states are
        rebuilt from what follows, so that they stay what the stream says on every replica, and
        the replica is behind until it reads a marker appended now.
        Skipping offsets already seen instead skipped a new stream's entries until it outgrew the
        old one: every idempotent submit was 503 meanwhile."""
        logger.info("jobs: reading the idempotency stream from its start again")
        self.states.clear()
        self._catch_up()

    async def aclose(self) -> None:
        self._marker = None
        for task in (*self._marking, *self._acks.tasks()):
            task.cancel()
        await asyncio.gather(*self._marking, *self._acks.tasks(), return_exceptions=True)

    def _read(self, body: bytes) -> None:
        if len(body) > MAX_ENTRY_BYTES:
            logger.warning("jobs: ignoring an idempotency entry of %d bytes (at most %d)", len(body), MAX_ENTRY_BYTES)
            return
        try:
            entry = Entry.model_validate_json(body)
        except ValidationError as exc:
            if b'"job_ids"' not in body:  # not an earlier version's claim: worth a line
                logger.warning("jobs: ignoring a malformed idempotency entry: %s", exc)
            return
        if entry.claim == self._marker:
            self._marker, self._caught_up = None, time.monotonic()
            logger.info(  # the stream's name (a queue's): not at info (issue 46)
                "jobs: read the idempotency stream up to its end: %d entries in %.1f s",
                self._read_behind,
                self._caught_up - self._behind_since,
            )
            return
        if time.time() - entry.at >= self.ttl:
            return
        decision = self.apply(entry)
        future = self._decisions.pop(bytes.fromhex(entry.claim), None)
        if future is not None and decision is not None and not future.done():
            future.set_result(decision)

    def apply(self, entry: Entry) -> Decision | None:
        """Apply one entry of the stream, in order; an intent's decision. Pure but for the
        state: every replica reaches the same decisions from the same entries."""
        key, claim, fp = bytes.fromhex(entry.key), bytes.fromhex(entry.claim), bytes.fromhex(entry.fingerprint)
        state = self.states.get(key)
        if entry.kind == "outcome":
            self._settle(key, state, claim, fp, entry)
            return None
        released = state is None or state.holder is None or entry.at - state.since > self.hold
        if state is None or (state.published == 0 and released):  # a new key, or one nothing was queued for
            first = state.at if state is not None and state.fingerprint == fp else entry.at
            self._put(key, KeyState(fp, entry.count, 0, claim, entry.at, first))
            return Decision("publish")
        if state.fingerprint != fp:
            return Decision("conflict")
        if state.complete:
            return Decision("replay", state.published)
        if not released:
            return Decision("wait", state.published, state.since + self.hold)
        self._put(key, replace(state, holder=claim, since=entry.at))
        return Decision("publish", state.published)

    def _settle(self, key: bytes, state: KeyState | None, claim: bytes, fp: bytes, entry: Entry) -> None:
        if state is None:
            if entry.published:  # its intent was forgotten (memory bound): keep what was confirmed
                self._put(key, KeyState(fp, entry.count, entry.published, None, entry.at, entry.at))
        elif state.fingerprint == fp:
            holder = None if state.holder == claim else state.holder
            if state.published | entry.published == 0 and holder is None:
                self.states.pop(key, None)  # nothing was queued: the key is free again
            else:
                self._put(key, replace(state, published=state.published | entry.published, holder=holder))
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _put(self, key: bytes, state: KeyState) -> None:
        try:
            self.states[key] = state
        except ValueError:  # larger than the whole bound: keep nothing rather than fail
            self.states.pop(key, None)

    def get(self, key: bytes) -> KeyState | None:
        return self.states.get(key)

    def holding(self, key: bytes, decision: Decision) -> bool:
        """Whether the intent that made ``decision`` wait still holds the key (its outcome may have
        been read since the decision)."""
        state = self.states.get(key)
        return state is not None and state.holder is not None and state.since + self.hold == decision.until

    def confirmed(self, key: bytes, fp: bytes, published: int) -> None:
        """Images this replica saw confirmed, known here before its outcome comes back from the
        stream: only ever fewer publishes follow from it."""
        state = self.states.get(key)
        if state is not None and state.fingerprint == fp and published:
            self._put(key, replace(state, published=state.published | published))

    async def claim(
        self, append: Callable[[aio_pika.Message], Awaitable[None]], key: bytes, fp: bytes, count: int, timeout: float
    ) -> tuple[bytes, Decision]:
        """Append an intent and wait until the stream has brought it back here: the decision
        every replica takes for it. 503 when it cannot be appended or does not come back."""
        claim = secrets.token_bytes(DIGEST_BYTES)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._decisions[claim] = future
        try:
            await append(self.message("intent", key, claim, fp, count))
            try:
                async with asyncio.timeout(timeout):
                    return claim, await future
            except TimeoutError:
                logger.warning(
                    "idempotency: a claim did not come back from the stream %s within %g s", self.stream, timeout
                )
                raise BackendUnavailable(
                    f"the idempotency claim did not come back within {timeout:g} s (GATEWAY_PUBLISH_TIMEOUT); "
                    "nothing was queued, retry with the same Idempotency-Key"
                ) from None
        finally:
            self._decisions.pop(claim, None)

    async def released(self, key: bytes, timeout: float) -> None:
        """Until an outcome for ``key`` is read, or ``timeout`` seconds."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[key]

    def message(
        self, kind: Literal["intent", "outcome"], key: bytes, claim: bytes, fp: bytes, count: int, published: int = 0
    ) -> aio_pika.Message:
        entry = Entry(
            kind=kind,
            key=key.hex(),
            claim=claim.hex(),
            fingerprint=fp.hex(),
            count=count,
            published=published,
            at=time.time(),
        )
        return aio_pika.Message(
            entry.model_dump_json().encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
