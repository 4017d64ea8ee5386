"""Per-API-key quotas: a rate in images/s (a token bucket, refilled continuously up to a burst)
and a limit on the requests a key may have in progress at once.

Keys are configured in ``GATEWAY_API_KEYS`` / ``GATEWAY_API_KEYS_FILE``, one per entry, each
optionally followed by its own limits: ``KEY rate=20 burst=40 concurrency=4``; a limit a key does
not name comes from ``GATEWAY_KEY_RATE`` / ``_BURST`` / ``_CONCURRENCY`` (0: unlimited).

A key is never written anywhere: metrics and logs name it by :attr:`ApiKey.id`, the first 12 hex
digits of its SHA-256.

Every worker process of one gateway shares the state, in the folder the processes already share
for Prometheus' multiprocess mode, so a key gets its quota whichever process its connections land
on: the buckets in a small table (a file mapped into memory, guarded by ``flock``), and the
requests in progress as kernel locks on bytes of lock files (:class:`Slots`), which the kernel
drops when their process ends, however it ends. Each replica of a deployment keeps its own state:
with N replicas behind a balancer a key may get up to N times its limits (divide them by the
replica count, or route a key to one replica).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import mmap
import os
import random
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from service.errors import PayloadTooLarge, QuotaExceeded
from service.settings.keys import MAX_CONCURRENCY, ApiKey, Quota

BUCKET = struct.Struct("<dd")
"""Per key: tokens, and when they were last refilled (CLOCK_MONOTONIC, the same in every process of
the host; 0: never used, the bucket is full)."""
STATE_FILE = "quotas.bin"
"""The buckets' table in the folder the worker processes share (``gateway serve`` removes a
previous run's before starting them)."""
SLOTS_DIR = "quotas-slots"
"""The lock files of :class:`Slots` in that folder. They hold no data (only their locks matter, and
the kernel drops those with their processes), so nothing needs clearing between runs."""
SLOT_FILES = 16
"""Lock files keys are spread over: the kernel checks a new lock against every lock on its file."""
_FLOCK = struct.Struct("hhqqi")
"""``struct flock``: type, whence, start, length, pid (0, as open file description locks want)."""
_BUSY = (errno.EAGAIN, errno.EACCES)


@dataclass(frozen=True)
class _Place:
    """Where a key's slots are: a lock file (its index) and the first of ``count`` bytes in it."""

    file: int
    start: int
    count: int


class Slots:
    """Requests in progress, counted by the kernel: each is a lock on one byte of its key's slots.

    A key allowed C requests in progress owns C bytes of a lock file, placed by its id (so every
    process agrees whatever order the keys are listed in, and any number of keys fit); a request
    takes a write lock on a free one without waiting (``F_OFD_SETLK``) and gives it back when done.
    Open file description locks belong to the open file, not to the process: two processes (or two
    instances in one process) conflict, and the kernel drops a process's locks when it exits, also
    when it is SIGKILLed, so a dead worker's requests stop counting at once. An instance's own locks
    do not conflict with each other, so it keeps which bytes it holds (guarded by a thread lock).

    A process forked from one holding slots closes its copies of the files (which would keep the
    parent's locks alive after the parent dies) and opens its own."""

    def __init__(self, directory: Path | None) -> None:
        """``directory``: the folder the worker processes share; None for slots private to this instance."""
        if not hasattr(fcntl, "F_OFD_SETLK"):
            raise RuntimeError("per-key concurrency limits need open file description locks (Linux 3.15 or later)")
        self._directory = directory
        self._lock = threading.Lock()
        self._held: dict[int, set[int]] = {}
        self._fds = self._open()
        os.register_at_fork(after_in_child=_forked_callback(weakref.ref(self)))

    def _open(self) -> list[int]:
        if self._directory is None:
            with tempfile.TemporaryDirectory(prefix="gateway-quota-slots-") as private:
                return self._open_files(Path(private))  # unlinked on leaving: private to this instance
        folder = self._directory / SLOTS_DIR
        folder.mkdir(exist_ok=True)
        return self._open_files(folder)

    @staticmethod
    def _open_files(folder: Path) -> list[int]:
        return [os.open(folder / f"{index:x}", os.O_RDWR | os.O_CREAT, 0o600) for index in range(SLOT_FILES)]

    @staticmethod
    def place(key_id: str, count: int) -> _Place:
        """Where the slots of the key with id ``key_id`` (12 hex digits) are, ``count`` of them."""
        number = int(key_id, 16)  # 48 bits: regions of MAX_CONCURRENCY bytes end below 2**56, far from 2**63
        return _Place(number % SLOT_FILES, number * MAX_CONCURRENCY, min(count, MAX_CONCURRENCY))

    def take(self, place: _Place) -> bool:
        """Lock a free slot of ``place`` for this instance; False when all of them are taken."""
        fd = self._fds[place.file]
        with self._lock:
            held = self._held.setdefault(place.start, set())
            if len(held) >= place.count:
                return False
            first = random.randrange(place.count) if place.count > 1 else 0  # spreads the processes' tries
            for index in range(place.count):
                offset = place.start + (first + index) % place.count
                # after a first try, ask before trying: a refused try costs an exception, twice a question
                if offset not in held and (index == 0 or _free(fd, offset)) and _lock(fd, offset):
                    held.add(offset)
                    return True
            return False

    def give(self, place: _Place) -> None:
        """Unlock one of the slots of ``place`` this instance holds."""
        with self._lock:
            held = self._held.get(place.start)
            if not held:
                return
            _unlock(self._fds[place.file], held.pop())

    def _after_fork(self) -> None:
        for fd in self._fds:
            os.close(fd)  # our copy only: the parent's locks stay the parent's, and end with it
        self._lock = threading.Lock()
        self._held = {}
        self._fds = self._open() if self._fds else []

    def close(self) -> None:
        """Close the files, which drops every lock this instance holds."""
        with self._lock:
            fds, self._fds, self._held = self._fds, [], {}
        for fd in fds:
            os.close(fd)


def _lock(fd: int, offset: int) -> bool:
    """Lock the byte at ``offset`` for this open file, unless another one holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


def _free(fd: int, offset: int) -> bool:
    """Whether no other open file holds the byte at ``offset``."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return bool(_FLOCK.unpack(answer)[0] == fcntl.F_UNLCK)


def _unlock(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))


def _forked_callback(ref: weakref.ref[Slots]) -> Callable[[], None]:
    def after_fork() -> None:
        slots = ref()
        if slots is not None:
            slots._after_fork()

    return after_fork


class Quotas:
    """The limits of every configured key, enforced against one shared state.

    ``max_images`` (the most images one request may carry) sets the default burst's floor, so a
    full-size request can always pass a full bucket."""

    def __init__(self, keys: list[ApiKey], max_images: int, shared_dir: Path | None = None) -> None:
        """``shared_dir``: the folder the worker processes share; None for a private state."""
        self.quotas = {key.id: self._effective(key.quota, max_images) for key in keys}
        for key in keys:  # a key's rate on one model: a bucket of its own, "KEY@MODEL"
            for model, rate in key.quota.model_rates:
                self.quotas[f"{key.id}@{model}"] = self._effective(Quota(rate=rate), max_images)
        self.buckets = {name: i for i, name in enumerate(name for name, q in self.quotas.items() if q.rate > 0)}
        self.places = {key.id: Slots.place(key.id, key.quota.concurrency) for key in keys if key.quota.concurrency > 0}
        size = max(1, len(self.buckets)) * BUCKET.size
        if shared_dir is None:
            handle, name = tempfile.mkstemp(prefix="gateway-quotas-")
            os.unlink(name)  # private to this process
        else:
            handle = os.open(shared_dir / STATE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(handle, max(os.fstat(handle).st_size, size))
        self._fd = handle
        self._map = mmap.mmap(handle, size)
        self.slots = Slots(shared_dir) if self.places else None

    @staticmethod
    def _effective(quota: Quota, max_images: int) -> Quota:
        if quota.rate > 0 and quota.burst <= 0:
            return replace(quota, burst=max(quota.rate, float(max_images)))
        return quota

    @contextlib.contextmanager
    def _bucket(self, key_id: str) -> Iterator[list[float]]:
        """The key's (tokens, refilled), locked across processes; written back after."""
        offset = self.buckets[key_id] * BUCKET.size
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            values = list(BUCKET.unpack_from(self._map, offset))
            yield values
            BUCKET.pack_into(self._map, offset, *values)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def enter(self, key_id: str) -> None:
        """Hold one of the key's slots for a request in progress, or refuse it when the key has
        none free (every one held by a request of a live process)."""
        place = self.places.get(key_id)
        if place is None or self.slots is None or self.slots.take(place):
            return
        raise QuotaExceeded(
            f"this API key already has {place.count} request(s) in progress, its limit; retry when one finishes",
            retry_after=1,
        )

    def leave(self, key_id: str) -> None:
        """Free a slot :meth:`enter` took for the key in this process."""
        place = self.places.get(key_id)
        if place is not None and self.slots is not None:
            self.slots.give(place)

    def take(self, key_id: str, images: int, model: str | None = None) -> None:
        """Spend ``images`` of the key's tokens (and of its tokens on ``model``, where it has a rate
        there), or refuse with the seconds until there will be enough; nothing is spent on a refusal."""
        if model is not None and f"{key_id}@{model}" in self.buckets:
            self._spend(f"{key_id}@{model}", images, f"its rate on model {model!r}")
            try:
                self._spend(key_id, images, "its rate")
            except QuotaExceeded:
                self._refund(f"{key_id}@{model}", images)
                raise
            return
        self._spend(key_id, images, "its rate")

    def _refund(self, name: str, images: int) -> None:
        quota = self.quotas[name]
        with self._bucket(name) as bucket:
            bucket[0] = min(quota.burst, bucket[0] + images)

    def _spend(self, key_id: str, images: int, what: str) -> None:
        quota = self.quotas.get(key_id)
        if quota is None or quota.rate <= 0:
            return
        if images > quota.burst:
            raise PayloadTooLarge(
                f"this request has {images} images and this API key may send at most {quota.burst:g} at once; split it"
            )
        now = time.monotonic()
        with self._bucket(key_id) as bucket:
            tokens, refilled = bucket
            tokens = quota.burst if refilled == 0 else min(quota.burst, tokens + (now - refilled) * quota.rate)
            bucket[1] = now
            if tokens < images:
                bucket[0] = tokens
                wait = (images - tokens) / quota.rate
                raise QuotaExceeded(
                    f"this API key is over {what} of {quota.rate:g} images/s; {images} image(s) fit again in "
                    f"{wait:.1f} s",
                    retry_after=max(1, math.ceil(wait)),
                )
            bucket[0] = tokens - images

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
        self._map.close()
        os.close(self._fd)
