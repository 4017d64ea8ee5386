"""What a worker does besides its jobs, in the background: sample the depth of the gateway's
queues, move jobs out of the classic queue of earlier versions, and touch its heartbeat file."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from pathlib import Path

from service.jobs.broker import Broker
from service.jobs.topology import migrate_legacy
from service.metrics import Metrics

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0


async def until(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less once ``stop`` is set."""
    with suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def sample_depth(broker: Broker, metrics: Metrics, stop: asyncio.Event, interval: float = 5.0) -> None:
    """Queue lengths as the broker counts them now. A passive declare on aio-pika's robust channel
    returns the queue object it cached, with the count of its first declaration, so ask the
    underlying channel each time.

    Ends when ``stop`` is set, after the broker call in progress: it is never cancelled mid-call (an
    AMQP call cancelled while its answer is due left its task waiting for ever at shutdown)."""
    while not stop.is_set():
        if broker.is_open and broker.channel is not None:
            for name in sorted({broker.names.work, broker.names.dead, *(route.queue for route in broker.routes)}):
                try:
                    channel = await broker.channel.get_underlay_channel()
                    declared = await channel.queue_declare(queue=name, passive=True, timeout=5)
                    metrics.queue_depth_messages.labels(name).set(declared.message_count or 0)
                except Exception as exc:
                    logger.debug("worker: cannot sample %s: %s", name, exc)
        await until(stop, interval)


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
    """Touch ``path`` from the event loop: its age is how long the loop has been stuck."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        path.touch()  # noqa: ASYNC240 - on the loop on purpose: the loop itself is what proves alive
        await asyncio.sleep(interval)


def heartbeat_age(path: Path) -> float:
    """Seconds since the worker's event loop last touched ``path`` (inf when never)."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return float("inf")
