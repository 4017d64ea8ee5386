"""What a worker does besides its jobs, in the background: sample the depth of the gateway's
queues (and of the ingest runs' it knows), move jobs out of the classic queue of earlier versions,
and touch its heartbeat file."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import aiormq
from aio_pika.abc import AbstractChannel

from service.jobs.broker import Broker
from service.jobs.topology import Names, migrate_legacy
from service.metrics import Metrics
from service.settings.values import setting_name

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
INGEST_QUEUES_MAX = 64
"""Ingest runs' queues a worker samples at most (a bound on the series, whatever ``reply_to`` says)."""


async def until(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less once ``stop`` is set."""
    with suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


class IngestQueues:
    """The results queues of the ``gateway ingest`` runs whose jobs this worker handled (by their
    ``reply_to``), sampled with the gateway's own queues: AMQP cannot list queues, and an ingest
    run's queue is the one that fills while nobody reads it. At most ``INGEST_QUEUES_MAX``, the
    oldest forgotten first; one the broker no longer has (its run finished, or it expired) is
    forgotten with its series. A worker started after a run's last job does not know that run's
    queue; the queue's expiry bounds it anyway."""

    def __init__(self, names: Names) -> None:
        self.names = names
        self._queues: dict[str, None] = {}
        """Insertion-ordered."""

    def saw(self, reply_to: str | None) -> None:
        queue = self.names.ingest_run(reply_to or "")
        if queue is None or queue in self._queues:
            return
        self._queues[queue] = None
        while len(self._queues) > INGEST_QUEUES_MAX:
            del self._queues[next(iter(self._queues))]

    def forget(self, queue: str) -> None:
        self._queues.pop(queue, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._queues))


async def sample_depth(
    broker: Broker,
    metrics: Metrics,
    stop: asyncio.Event,
    interval: float = 5.0,
    ingest: IngestQueues | None = None,
) -> None:
    """Queue lengths as the broker counts them now: the work queues, ``<prefix>.dead``,
    ``<prefix>.results`` and the ingest runs' queues a worker knows. A passive declare on
    aio-pika's robust channel returns the queue object it cached, with the count of its first
    declaration, so ask the underlying channel each time.

    Ends when ``stop`` is set, after the broker call in progress: it is never cancelled mid-call (an
    AMQP call cancelled while its answer is due left its task waiting for ever at shutdown)."""
    names = broker.names
    sampled: set[str] = set()
    """The ingest queues with a series."""
    while not stop.is_set():
        if broker.is_open and broker.channel is not None:
            for name in sorted({names.work, names.dead, names.results, *(route.queue for route in broker.routes)}):
                try:
                    channel = await broker.channel.get_underlay_channel()
                    declared = await channel.queue_declare(queue=name, passive=True, timeout=5)
                    metrics.queue_depth_messages.labels(name).set(declared.message_count or 0)
                except Exception as exc:
                    logger.debug("worker: cannot sample %s: %s", name, exc)
            if ingest is not None:
                sampled = await _sample_ingest(broker, metrics, ingest, sampled)
        await until(stop, interval)


async def _sample_ingest(broker: Broker, metrics: Metrics, ingest: IngestQueues, sampled: set[str]) -> set[str]:
    """Sample the ingest queues on a channel of their own (a queue that is gone closes the channel
    it was asked on); drop the series of those forgotten. The ones with a series now."""
    now: set[str] = set()
    opened: list[AbstractChannel] = []
    probe: aiormq.abc.AbstractChannel | None = None
    try:
        for name in ingest:
            if broker.connection is None or broker.connection.is_closed:
                break
            if probe is None or probe.is_closed:
                opened.append(await broker.connection.channel())
                probe = await opened[-1].get_underlay_channel()
            try:
                declared = await probe.queue_declare(queue=name, passive=True, timeout=5)
            except aiormq.exceptions.ChannelNotFoundEntity:
                ingest.forget(name)
                continue
            except Exception as exc:
                logger.debug("worker: cannot sample %s: %s", name, exc)
                continue
            metrics.queue_depth_messages.labels(name).set(declared.message_count or 0)
            now.add(name)
    finally:
        for each in opened:  # closed by us even when the broker closed it: else it reopens itself
            with suppress(Exception):
                await each.close()
    for name in sampled - now:
        with suppress(KeyError):
            metrics.queue_depth_messages.remove(name)
    return now


async def migrate_legacy_queue(broker: Broker, stop: asyncio.Event, interval: float = 60.0) -> None:
    """Drain the classic requests queue of earlier versions into the quorum queue, now and then
    (an API replica of the old version may still publish to it during a rolling upgrade). Ends
    when ``stop`` is set, like ``sample_depth``."""
    while not stop.is_set():
        if broker.is_open and broker.connection is not None:
            try:
                moved = await migrate_legacy(broker.connection, broker.names)
                if moved:
                    logger.warning(
                        "worker: moved %d jobs from the classic queue %s to %s",
                        moved,
                        broker.names.legacy_requests,
                        broker.names.work,
                    )
            except Exception as exc:
                logger.warning("worker: could not migrate %s: %s", broker.names.legacy_requests, exc)
        await until(stop, interval)


async def heartbeat(path: Path, interval: float) -> None:
    """Touch ``path`` from the event loop: its age is how long the loop has been stuck.

    One worker's loop at a time: the worker that holds the file's lock (``flock``, which the kernel
    releases when that process ends, however it ends). Another worker given the same file (two on a
    host with the same settings, or a new one started while the old one drains) touches nothing
    until that lock is free, then takes the file over, so its age is always one worker's. Before,
    both touched it: either one's heartbeat hid the other's stuck loop from ``gateway alive``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    held = waited = False
    try:
        while True:
            if not held:
                held = _lock(fd)
                if held and waited:
                    logger.warning("worker: the other worker has stopped; the heartbeat file is this one's now")
                elif not held and not waited:
                    waited = True
                    logger.warning(
                        "worker: another worker on this host touches the heartbeat file %s; this one will "
                        "once that one has stopped (for gateway alive to check each worker, give each its own %s)",
                        path,
                        setting_name("worker_heartbeat_file"),
                    )
            if held:
                os.utime(fd)  # on the loop on purpose: the loop itself is what proves alive
            await asyncio.sleep(interval)
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int) -> bool:
    """Take the heartbeat file's lock if no other worker holds it (on a file system without locks,
    the file is touched unlocked, as it was before locks)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        logger.warning("worker: the heartbeat file cannot be locked (%s); touched without its lock", exc)
    return True


def heartbeat_age(path: Path) -> float:
    """Seconds since the worker's event loop last touched ``path`` (inf when never)."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return float("inf")
