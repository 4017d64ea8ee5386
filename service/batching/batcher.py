"""The dynamic batcher: groups single images into backend batches.

* It waits on an Event, never polls. The clock is the event loop's (monotonic).
* An idle backend gets whatever is queued at once, so a lone request pays no delay. While the
  backend is busy (``busy_at`` batches in it: any one for a GPU or Triton; every slot for an
  in-process CPU runtime, whose free slot is idle cores), a new batch may wait up to ``max_delay``
  (from its oldest image) to fill; it leaves early when it is full or when the backend goes idle.
* ``max_inflight_batches`` batches may be in the backend at once, so the next batch forms while
  one runs.
* Admission is all-or-nothing per request and bounded by ``max_queue_size`` (``QueueFull``).
* Cancellation-safe: a request that is cancelled or passes its deadline leaves the queue; if its
  batch is already running, its result is dropped and nobody else is affected. Futures are
  completed only if not already done. Images of a cancelled request (its client went away) that
  were never sent to the backend are counted (``on_abandon``).
* Every failure of a batch reaches every request in it, and the backend must return one result
  per image, finite: a row with NaN or inf fails its image with ``BackendError``.
* Two policies decide how long a batch waits to fill while the backend is busy:
  ``fixed`` waits for ``max_batch_size`` images or ``max_delay``, whichever comes first;
  ``adaptive`` learns the backend's batch time ``a * n + b`` online (``BatchLatencyModel``) and the
  arrival rate, and waits only for the smallest batch that lets the backend keep up with the
  arrivals (with headroom), still within ``max_delay`` and the oldest request's deadline. It also
  refuses at admission (``DeadlineUnmeetable``, 429) a request that the queue ahead would make
  miss its deadline.
* With tracing on, a request submitted with its sampled span context gets a ``batch wait`` span
  (admission to dispatch), and each batch serving such requests a ``batch`` span: a child of the
  first, linked to all, current while the backend runs (so Triton gets its context).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext, suppress
from functools import partial
from typing import Any, Literal, Protocol

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode

from service.batching.adaptive import AdaptivePolicy, BatchLatencyModel
from service.batching.items import NO_IMAGE, BatchReport, Item, expire, fail
from service.errors import (
    BackendError,
    BackendUnavailable,
    DeadlineExceeded,
    DeadlineUnmeetable,
    GatewayError,
    QueueFull,
    public_text,
)
from service.host.stages import ObserveStage
from service.tracing import Tracing, epoch_ns, trace_id_hex

logger = logging.getLogger(__name__)


class InferFn(Protocol):
    def __call__(self, images: list[np.ndarray], *, timeout: float | None = None) -> Awaitable[np.ndarray]: ...


Policy = Literal["fixed", "adaptive"]


class DynamicBatcher:
    def __init__(
        self,
        infer: InferFn,
        *,
        max_batch_size: int,
        max_delay: float,
        max_queue_size: int,
        max_inflight_batches: int,
        on_batch: Callable[[BatchReport], None] | None = None,
        tracing: Tracing | None = None,
        backend_name: str = "",
        policy: Policy = "fixed",
        rank: Callable[[np.ndarray], Sequence[Any]] | None = None,
        on_abandon: Callable[[int], None] | None = None,
        busy_at: int = 1,
        on_stage: ObserveStage | None = None,
    ) -> None:
        """``busy_at``: the batches in flight at which the backend is busy, so that the next batch
        waits to fill (1: any; ``max_inflight_batches``: every slot, for a backend whose batches
        each run on their own cores, where a free slot is idle compute). ``rank``, when given,
        turns a batch's scores into one answer per row, once per batch (e.g. every row's top
        classes); each request then gets its rows' answers instead of the score rows themselves.
        ``on_abandon`` gets the number of images of a cancelled request that never reached the
        backend (dropped from the queue, or before their decode). ``on_stage`` gets each image's
        stage times (``service.host.stages``: its decode's, its wait here, its batch's backend call,
        its task's wake-up)."""
        if max_batch_size < 1 or max_queue_size < 1 or max_inflight_batches < 1 or max_delay < 0 or busy_at < 1:
            raise ValueError("batcher limits must be positive")
        self.busy_at = min(busy_at, max_inflight_batches)
        self.policy = policy
        self.adaptive = AdaptivePolicy(max_batch_size, max_inflight_batches) if policy == "adaptive" else None
        """The adaptive policy's learned batch times and arrival rate (None: fixed policy)."""
        self.target = max_batch_size
        """The batch size the policy last waited for."""
        self.arrived = 0
        """Images queued since the start (``gateway_batcher_arrivals_total``)."""
        self._preparing = 0
        """Images of ``submit_prepared`` requests being decoded or waiting for a decode thread: they
        will be queued ahead of anything admitted now."""
        self._infer = infer
        self._rank = rank
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_queue_size = max_queue_size
        self.max_inflight_batches = max_inflight_batches
        self._on_batch = on_batch
        self._on_abandon = on_abandon
        self._on_stage = on_stage
        self._tracing = tracing
        self._backend_name = backend_name
        self._queue: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._wanted = 1
        """Queued images at which ``submit`` wakes the batcher: 1 when it waits for work, a full
        batch while it fills one."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots = asyncio.Semaphore(max_inflight_batches)
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def inflight_batches(self) -> int:
        return self._inflight

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="batcher")

    def _check_open(self) -> None:
        if self._closing or self._loop_task is None:
            raise BackendUnavailable("the gateway is shutting down" if self._closing else "batcher not started")

    def _check_room(self, count: int, deadline: float | None = None) -> None:
        if len(self._queue) + count > self.max_queue_size:
            raise QueueFull(f"{len(self._queue)} images are queued and the limit is {self.max_queue_size}; retry later")
        if deadline is not None and self.model is not None:
            self._check_deadline(count, deadline)

    @property
    def model(self) -> BatchLatencyModel | None:
        """The batch times learned (adaptive policy only)."""
        return self.adaptive.model if self.adaptive is not None else None

    def predicted_wait(self, count: int) -> float | None:
        """Seconds until ``count`` more images would be answered, behind the queue and the batches
        running now (None with the fixed policy, or before the model has seen a batch)."""
        if self.adaptive is None:
            return None
        return self.adaptive.predicted_wait(len(self._queue) + self._preparing + count, self._inflight)

    def _check_deadline(self, count: int, deadline: float) -> None:
        wait = self.predicted_wait(count)
        if wait is None:
            return
        left = deadline - asyncio.get_running_loop().time()
        if wait > left:
            raise DeadlineUnmeetable(
                f"{len(self._queue) + self._preparing} images are ahead: about {wait:.2f} s to answer, and "
                f"the request's deadline is {max(left, 0.0):.2f} s away; retry later",
                retry_after=max(1, math.ceil(wait)),
            )

    def _target(self, now: float) -> int:
        """How many images the next batch waits for while the backend is busy."""
        return self.adaptive.target(now) if self.adaptive is not None else self.max_batch_size

    def _enqueue(self, items: list[Item]) -> None:
        self.arrived += len(items)
        if self.adaptive is not None:
            self.adaptive.arrived(len(items))
        self._queue.extend(items)
        self._idle.clear()
        if len(self._queue) >= self._wanted:
            self._wake.set()

    async def _results(self, items: list[Item], deadline: float | None) -> list[Any]:
        """Wait for the items' rows; at the deadline (one timer per request, not an asyncio
        timeout: this is the serving path's hottest code) the unfinished ones fail."""
        loop = asyncio.get_running_loop()
        expiry = None if deadline is None else loop.call_at(deadline, expire, items)
        try:
            if len(items) == 1:  # the common case: no gathering future
                rows = [await items[0].future]
            else:
                rows = list(await asyncio.gather(*(item.future for item in items)))
            if self._on_stage is not None and items[-1].answered:
                self._on_stage("wake", time.perf_counter() - items[-1].answered)
            return rows
        finally:
            if expiry is not None:
                expiry.cancel()
            self._forget(items)

    async def submit(
        self, images: Sequence[np.ndarray], *, deadline: float | None = None, parent: SpanContext | None = None
    ) -> list[Any]:
        """Queue the images as one request and return their score rows in order (their answers,
        when the batcher ranks).

        ``deadline`` is on the event loop's clock (``loop.time()``); ``parent`` is the request's span
        context when its trace is sampled."""
        self._check_open()
        if not images:
            return []
        self._check_room(len(images), deadline)
        loop = asyncio.get_running_loop()
        now = loop.time()
        items = [Item(img, loop.create_future(), deadline, now, parent) for img in images]
        if self._on_stage is not None:
            for item in items:
                item.timed_into_queue(self._on_stage)
        self._enqueue(items)
        return await self._results(items, deadline)

    async def submit_prepared(
        self,
        prepare: Callable[[], np.ndarray],
        executor: Executor,
        *,
        deadline: float | None = None,
        parent: SpanContext | None = None,
    ) -> Any:
        """Run ``prepare`` (decoding one image) in ``executor`` and queue its image from there, as a
        request of one image; return its score row. ``prepare``'s error is the request's error.

        The caller's task wakes once, for the result, where ``run_in_executor`` then ``submit``
        would wake it for the image too: on the serving path that wake-up and its futures cost more
        than the batching itself. The deadline covers both stages."""
        self._check_open()
        if self.model is not None and deadline is not None:  # refuse before spending a decode on it
            self._check_deadline(1, deadline)
        loop = asyncio.get_running_loop()
        item = Item(NO_IMAGE, loop.create_future(), deadline, 0.0, parent)

        def work() -> None:
            done: Callable[[], None]
            if item.future.done():  # cancelled or timed out while waiting for a thread: no decode
                done = self._prepared_none
            else:
                item.picked = time.perf_counter()
                try:
                    done = partial(self._admit, item, prepare())
                    item.prepared = time.perf_counter()
                except Exception as exc:
                    done = partial(self._prepare_failed, item, exc)
            with suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(done)

        self._preparing += 1
        item.submitted = time.perf_counter()
        try:
            executor.submit(work)
        except RuntimeError:  # the pool has shut down
            self._preparing -= 1
            raise BackendUnavailable("the gateway is shutting down") from None
        (row,) = await self._results([item], deadline)
        return row

    def _prepared_none(self) -> None:
        self._preparing -= 1

    def _prepare_failed(self, item: Item, exc: Exception) -> None:
        self._preparing -= 1
        fail(item, exc)

    def _admit(self, item: Item, image: np.ndarray) -> None:
        """Queue a prepared image (on the loop), unless its request is over or there is no room."""
        self._preparing -= 1
        if item.future.done():
            return
        try:
            self._check_open()
            self._check_room(1, item.deadline)
        except GatewayError as exc:
            item.future.set_exception(exc)
            return
        item.image = image
        item.enqueued = item.future.get_loop().time()
        if self._on_stage is not None:
            item.timed_into_queue(self._on_stage)
        self._enqueue([item])

    def _forget(self, items: list[Item]) -> None:
        """Drop a finished, failed or cancelled request's items that are still waiting."""
        if self._on_abandon is not None:
            # cancelled from outside (the request's task) before dispatch; not those cancelled below
            abandoned = sum(1 for item in items if item.future.cancelled() and not item.dispatched)
            if abandoned:
                self._on_abandon(abandoned)
        for item in items:
            if not item.future.done():
                item.future.cancel()
        if any(item in self._queue for item in items):
            self._queue = deque(i for i in self._queue if not i.future.done())
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._queue and self._inflight == 0:
            self._idle.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._slots.acquire()
            try:
                await self._fill(loop)
                batch = self._take(loop.time())
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                self._check_idle()
                continue
            self._inflight += 1
            task = asyncio.create_task(self._run_batch(batch, loop), name="batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            del batch, task  # not held while idle: the images (the shared engine's cells) go with their requests

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> None:
        """While the backend is busy (``busy_at`` batches in it besides the one being formed), wait
        for a full batch or until the oldest image's delay is up.

        Woken once per batch, not per request: ``submit`` sets the event only when the queue reaches
        ``_wanted`` images, a finished batch sets it (the backend may be idle now), and one timer
        sets it when the delay is up."""
        if not self._queue:
            return
        now = loop.time()
        target = self.target = self._target(now)
        oldest = self._queue[0]
        flush_at = oldest.enqueued + self.max_delay
        fit = self.model.fit if self.model is not None else None
        if fit is not None and oldest.deadline is not None:  # leave the oldest time to be answered
            flush_at = min(flush_at, oldest.deadline - fit.seconds(target))
        if self._inflight < self.busy_at or len(self._queue) >= target or flush_at <= now:
            return
        self._wanted = target
        timer = loop.call_at(flush_at, self._wake.set)
        try:
            while self._inflight >= self.busy_at and len(self._queue) < target and loop.time() < flush_at:
                self._wake.clear()
                await self._wake.wait()
        finally:
            timer.cancel()
            self._wanted = 1

    def _take(self, now: float) -> list[Item]:
        batch: list[Item] = []
        while self._queue and len(batch) < self.max_batch_size:
            item = self._queue.popleft()
            if item.future.done():
                continue
            if item.deadline is not None and item.deadline <= now:
                item.future.set_exception(DeadlineExceeded("the request deadline passed while queued"))
                continue
            item.dispatched = True
            batch.append(item)
        return batch

    def _trace_batch(self, batch: list[Item], traced: list[Item], started: float) -> trace.Span:
        """The batch's span (child of its first sampled request, linked to all of them) and each
        sampled request's ``batch wait`` span, which ended at dispatch (``started``, now) and links
        to the batch."""
        assert self._tracing is not None
        parents = [item.trace for item in traced if item.trace is not None]  # all of them: typed
        span = self._tracing.child(
            "batch",
            parents[0],
            kind=SpanKind.CLIENT,
            links=[Link(parent) for parent in parents],
            attributes={"gateway.batch.size": len(batch), "gateway.backend": self._backend_name},
        )
        to_batch = [Link(span.get_span_context())]
        dispatched = time.time_ns()
        for item, parent in zip(traced, parents, strict=True):
            start_ns = epoch_ns(item.enqueued, started)
            wait = self._tracing.child("batch wait", parent, start_ns=start_ns, links=to_batch)
            wait.end(end_time=dispatched)
        return span

    async def _run_batch(self, batch: list[Item], loop: asyncio.AbstractEventLoop) -> None:
        started = loop.time()
        error: GatewayError | None = None
        fit = self.model.fit if self.model is not None else None
        predicted = fit.seconds(len(batch)) if fit is not None else None
        traced = [item for item in batch if item.trace is not None] if self._tracing is not None else []
        span = self._trace_batch(batch, traced, started) if traced else None
        try:
            deadlines = [item.deadline for item in batch]
            timeout = None if None in deadlines else max(d for d in deadlines if d is not None) - started
            # the images as they are: the backend lays out its input off the loop (``BatchBuffer``)
            sent = time.perf_counter()
            with trace.use_span(span, end_on_exit=False) if span is not None else nullcontext():
                scores = await self._infer([item.image for item in batch], timeout=timeout)
            if self._on_stage is not None:
                self._stages_of(batch, sent)
            if len(scores) != len(batch):
                raise BackendError(f"backend returned {len(scores)} results for a batch of {len(batch)} images")
            finite = np.isfinite(scores).all(axis=tuple(range(1, np.ndim(scores))))
            rows: Sequence[Any] | np.ndarray = scores if self._rank is None else self._rank(scores)
            for item, row, ok in zip(batch, rows, finite, strict=True):
                if item.future.done():
                    continue
                if ok:
                    item.future.set_result(row)
                else:  # NaN/inf cannot be answered as JSON, nor ranked: that image failed
                    item.future.set_exception(BackendError("the backend returned non-finite scores (NaN or inf)"))
        except asyncio.CancelledError:
            error = BackendUnavailable("the gateway shut down before this batch finished")
            raise
        except GatewayError as exc:
            error = exc
        except Exception as exc:
            logger.exception("backend failed on a batch of %d images", len(batch))
            error = BackendError(f"the backend failed on the batch ({public_text(exc)})")  # the rest: logged
        finally:
            if error is not None:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(error)
            if span is not None:
                if error is not None:
                    span.set_status(StatusCode.ERROR, f"{error.error}: {error.detail}")
                    span.set_attribute("error.type", error.error)
                span.end()
            backend_seconds = loop.time() - started
            if self.adaptive is not None and error is None:
                self.adaptive.model.observe(len(batch), backend_seconds)
            self._inflight -= 1
            self._slots.release()
            self._wake.set()
            self._check_idle()
            if self._on_batch is not None:
                self._on_batch(
                    BatchReport(
                        size=len(batch),
                        queue_waits=[started - item.enqueued for item in batch],
                        backend_seconds=backend_seconds,
                        predicted_seconds=predicted,
                        error=None if error is None else error.error,
                        trace_ids=[trace_id_hex(i.trace) if i.trace is not None else None for i in batch]
                        if traced
                        else [],
                    )
                )

    def _stages_of(self, batch: list[Item], sent: float) -> None:
        """A batch's stages, its answer in hand: each image's wait, the backend call once."""
        assert self._on_stage is not None
        now = time.perf_counter()
        self._on_stage("backend", now - sent)
        for item in batch:
            if item.queued:
                self._on_stage("batch_wait", sent - item.queued)
            item.answered = now

    async def aclose(self, drain_timeout: float = 10.0) -> None:
        """Refuse new requests, let queued and running batches finish within ``drain_timeout``,
        then fail whatever is left with 503."""
        self._closing = True
        try:
            async with asyncio.timeout(drain_timeout):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "batcher: drain timed out with %d queued, %d batches running", len(self._queue), self._inflight
            )
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(t for t in (self._loop_task, *self._tasks) if t is not None), return_exceptions=True)
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(BackendUnavailable("the gateway shut down before this image was inferred"))
