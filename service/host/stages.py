"""Where a request's time goes, stage by stage: ``gateway_stage_seconds{stage=...}``.

The p99 of a request is made in one of its stages, and which one is a query, not a run with a
debugger: ``histogram_quantile(0.99, sum by (le, stage) (rate(gateway_stage_seconds_bucket[1m])))``.
The stages of one image sent alone (``POST /classify`` with one image, the serving path's common
case), in order:

* ``decode_queue``: waiting for a decode thread;
* ``decode``: decoded and resized (the same time as ``gateway_preprocess_duration_seconds``, in
  finer buckets);
* ``to_loop``: from the decode thread back to the event loop, which queues the image (a busy or
  blocked loop shows here);
* ``batch_wait``: queued in the batcher until its batch leaves;
* ``backend``: the batch's backend call, once per batch (with the shared engine: the hand-off to
  the engine process, its own ``engine_wait`` and ``gpu``, and the answer's way back);
* ``wake``: from the batch's answer to the request's task running again.

The shared engine adds its own, per batch it runs (``GATEWAY_TORCH_ENGINE=shared``):
``engine_wait`` (an image's wait in the engine's batcher), ``gpu`` (the engine's backend call) and
``engine_wake`` (from a batch's answer to the worker's call that waits for it running again).

And, in every process, what delays all of them at once: ``loop_lag`` (how late a timer set every
20 ms fires: a loop blocked by a slow callback, or starved of the CPU) and ``gc`` (each of Python's
collections of the older generations, which stop every thread of the process).

Times are ``time.perf_counter`` differences: the event loop's own clock is uvloop's, cached per
loop iteration at millisecond resolution.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

STAGE_BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    1.0,
    5.0,
)
"""Fine where the latency bound lives (15 ms at p99): a stage's p99 is read within a few ms."""

STAGES = (
    "decode_queue",
    "decode",
    "to_loop",
    "batch_wait",
    "backend",
    "wake",
    "engine_wait",
    "gpu",
    "engine_wake",
    "loop_lag",
    "gc",
)

ObserveStage = Callable[[str, float], None]
"""``observe(stage, seconds)``."""

LAG_INTERVAL = 0.02
"""Seconds between the loop-lag timer's firings (50 samples a second per process)."""


def stage_histogram(registry: CollectorRegistry | None) -> Histogram:
    return Histogram(
        "gateway_stage_seconds",
        "Time spent in each stage of the serving path (per image; backend and gpu: per batch), "
        "and the event loop's lateness and garbage-collection pauses per process.",
        ["stage"],
        buckets=STAGE_BUCKETS,
        registry=registry,
    )


def stage_observer(histogram: Histogram, renamed: dict[str, str] | None = None) -> ObserveStage:
    """``observe(stage, seconds)`` over the histogram's children, bound once (``labels()`` takes a
    lock and checks its values). ``renamed``: stages recorded under another name (the engine's
    batcher reports ``batch_wait`` and ``backend``, which are its ``engine_wait`` and ``gpu``)."""
    children = {stage: histogram.labels(stage) for stage in STAGES}
    for stage, name in (renamed or {}).items():
        children[stage] = children[name]

    def observe(stage: str, seconds: float) -> None:
        children[stage].observe(seconds)

    return observe


class PauseWatch:
    """The process's ``loop_lag`` and ``gc`` samples, while started (one per process)."""

    def __init__(self, observe: ObserveStage, interval: float = LAG_INTERVAL) -> None:
        self._observe = observe
        self._interval = interval
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._gc_started = 0.0

    def start(self) -> None:
        """On the running loop; GC pauses of every thread from now on."""
        loop = asyncio.get_running_loop()
        self._schedule(loop)
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = time.perf_counter() + self._interval
        self._timer = loop.call_later(self._interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._observe("loop_lag", max(0.0, time.perf_counter() - self._due))
        self._schedule(loop)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation", 0) < 1:  # the young generation's: hundreds a second, each short
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self._observe("gc", time.perf_counter() - self._gc_started)
            self._gc_started = 0.0
