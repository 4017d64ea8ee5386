"""Per-API-key quotas: a rate in images/s (a token bucket, refilled continuously up to a burst)
and a limit on the requests a key may have in progress at once.

Keys are configured in ``GATEWAY_API_KEYS`` / ``GATEWAY_API_KEYS_FILE``, one per entry, each
optionally followed by its own limits: ``KEY rate=20 burst=40 concurrency=4``; a limit a key does
not name comes from ``GATEWAY_KEY_RATE`` / ``_BURST`` / ``_CONCURRENCY`` (0: unlimited).

A key is never written anywhere: metrics and logs name it by :attr:`ApiKey.id`, the first 12 hex
digits of its SHA-256.

The state lives in a small table shared by every worker process of one gateway (a file in the
folder the processes already share for Prometheus' multiprocess mode, mapped into memory and
guarded by ``flock``), so a key gets its quota whichever process its connections land on. Each
replica of a deployment keeps its own table: with N replicas behind a balancer a key may get up to
N times its limits (divide them by the replica count, or route a key to one replica).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from service.errors import PayloadTooLarge, QuotaExceeded

SLOT = struct.Struct("<ddq")
"""Per key: tokens, when they were last refilled (CLOCK_MONOTONIC, the same in every process of
the host; 0: never used, the bucket is full), requests in progress."""
OPTIONS = ("rate", "burst", "concurrency")


@dataclass(frozen=True)
class Quota:
    rate: float = 0.0
    """Images per second (0: unlimited)."""
    burst: float = 0.0
    """Images a key may send at once after being idle (0: one second's worth, and at least one
    request's most images)."""
    concurrency: int = 0
    """Requests in progress at once (0: unlimited)."""

    @property
    def limited(self) -> bool:
        return self.rate > 0 or self.concurrency > 0


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    quota: Quota = Quota()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.secret).hexdigest()[:12]


def parse_keys(entries: Iterable[str], default: Quota) -> list[ApiKey]:
    """``KEY [rate=R] [burst=B] [concurrency=C]`` entries; blank ones and ``#`` comments skipped."""
    keys = []
    for entry in entries:
        words = entry.split()
        if not words or words[0].startswith("#"):
            continue
        secret, options = words[0], words[1:]
        values: dict[str, float | int] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in OPTIONS:
                raise ValueError(
                    f"API key entry option {option!r}: expected rate=, burst= or concurrency= "
                    f"(key {ApiKey(secret.encode()).id})"
                )
            try:
                number = int(value) if name == "concurrency" else float(value)
            except ValueError:
                raise ValueError(f"API key entry option {option!r} is not a number") from None
            if number < 0:
                raise ValueError(f"API key entry option {option!r} is negative")
            values[name] = number
        keys.append(ApiKey(secret.encode(), replace(default, **values)))  # type: ignore[arg-type]
    return keys


STATE_FILE = "quotas.bin"
"""The table's name in the folder the worker processes share (``gateway serve`` removes a previous
run's before starting them)."""


class Quotas:
    """The limits of every configured key, enforced against one shared table.

    ``max_images`` (the most images one request may carry) sets the default burst's floor, so a
    full-size request can always pass a full bucket."""

    def __init__(self, keys: list[ApiKey], max_images: int, shared_dir: Path | None = None) -> None:
        """``shared_dir``: the folder the worker processes share; None for a private table."""
        self.slots = {key.id: i for i, key in enumerate(keys) if key.quota.limited}
        self.quotas = {key.id: self._effective(key.quota, max_images) for key in keys}
        size = max(1, len(keys)) * SLOT.size
        if shared_dir is None:
            handle, name = tempfile.mkstemp(prefix="gateway-quotas-")
            os.unlink(name)  # private to this process
        else:
            handle = os.open(shared_dir / STATE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(handle, max(os.fstat(handle).st_size, size))
        self._fd = handle
        self._map = mmap.mmap(handle, size)

    @staticmethod
    def _effective(quota: Quota, max_images: int) -> Quota:
        if quota.rate > 0 and quota.burst <= 0:
            return replace(quota, burst=max(quota.rate, float(max_images)))
        return quota

    @contextlib.contextmanager
    def _slot(self, key_id: str) -> Iterator[list[float]]:
        """The key's (tokens, refilled, in progress), locked across processes; written back after."""
        offset = self.slots[key_id] * SLOT.size
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            values = list(SLOT.unpack_from(self._map, offset))
            yield values
            SLOT.pack_into(self._map, offset, values[0], values[1], int(values[2]))
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def enter(self, key_id: str) -> None:
        """Count a request in progress, or refuse it when the key already has its limit."""
        quota = self.quotas.get(key_id)
        if quota is None or quota.concurrency <= 0:
            return
        with self._slot(key_id) as slot:
            if slot[2] >= quota.concurrency:
                raise QuotaExceeded(
                    f"this API key already has {quota.concurrency} request(s) in progress, its limit; retry "
                    "when one finishes",
                    retry_after=1,
                )
            slot[2] += 1

    def leave(self, key_id: str) -> None:
        quota = self.quotas.get(key_id)
        if quota is None or quota.concurrency <= 0:
            return
        with self._slot(key_id) as slot:
            slot[2] = max(0, slot[2] - 1)

    def take(self, key_id: str, images: int) -> None:
        """Spend ``images`` tokens, or refuse with the seconds until there will be enough."""
        quota = self.quotas.get(key_id)
        if quota is None or quota.rate <= 0:
            return
        if images > quota.burst:
            raise PayloadTooLarge(
                f"this request has {images} images and this API key may send at most {quota.burst:g} at once; split it"
            )
        now = time.monotonic()
        with self._slot(key_id) as slot:
            tokens, refilled = slot[0], slot[1]
            tokens = quota.burst if refilled == 0 else min(quota.burst, tokens + (now - refilled) * quota.rate)
            slot[1] = now
            if tokens < images:
                slot[0] = tokens
                wait = (images - tokens) / quota.rate
                raise QuotaExceeded(
                    f"this API key is over its rate of {quota.rate:g} images/s; {images} image(s) fit again in "
                    f"{wait:.1f} s",
                    retry_after=max(1, math.ceil(wait)),
                )
            slot[0] = tokens - images

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
