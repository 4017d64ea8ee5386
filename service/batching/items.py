"""What the batcher holds per image, and what it reports per batch."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry.trace import SpanContext

from service.errors import DeadlineExceeded
from service.host.stages import ObserveStage


@dataclass(eq=False)
class Item:
    image: np.ndarray
    future: asyncio.Future[Any]
    """Its score row, or the row's answer when the batcher ranks."""
    deadline: float | None
    enqueued: float
    trace: SpanContext | None = None
    """The request's span context when its trace is sampled."""
    dispatched: bool = False
    """Taken into a batch (sent to the backend)."""
    submitted: float = 0.0
    """``time.perf_counter()`` when its decode was handed to the pool (``submit_prepared``)."""
    picked: float = 0.0
    """... when a decode thread began it."""
    prepared: float = 0.0
    """... when it was decoded."""
    queued: float = 0.0
    """... when it joined the batcher's queue."""
    answered: float = 0.0
    """... when its batch's answer was handed to it."""

    def timed_into_queue(self, observe: ObserveStage) -> None:
        """Its stages up to the queue (``service.host.stages``), now that the loop queues it."""
        self.queued = now = time.perf_counter()
        if self.prepared:
            observe("decode_queue", self.picked - self.submitted)
            observe("decode", self.prepared - self.picked)
            observe("to_loop", now - self.prepared)


NO_IMAGE = np.empty(0, np.uint8)
"""An item's image until it is prepared."""


def fail(item: Item, exc: Exception) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


def expire(items: list[Item]) -> None:
    for item in items:
        if not item.future.done():
            item.future.set_exception(DeadlineExceeded("the request deadline passed before inference finished"))


@dataclass(frozen=True)
class BatchReport:
    """What happened to one batch, for metrics."""

    size: int
    queue_waits: list[float] = field(repr=False)
    """Seconds each image waited between admission and dispatch."""
    backend_seconds: float
    error: str | None
    """The error code when the batch failed, else None."""
    trace_ids: list[str | None] = field(default_factory=list, repr=False)
    """Each image's trace id when its trace is sampled (empty when none is): metrics exemplars."""
    predicted_seconds: float | None = None
    """What the adaptive policy's model predicted for this batch (None: fixed policy, or not ready)."""
