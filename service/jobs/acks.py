"""Acknowledge a consumer's messages with ``multiple=True``: one frame for many.

A worker finishes its messages out of order (batches, publish confirms), and acks each only once
its outcome is confirmed. An ack with ``multiple`` settles every delivery up to its tag, so it may
only be sent for a tag whose every predecessor on the channel is finished too. :class:`Acks` keeps
each channel's deliveries by tag; once per event-loop turn in which messages finished, it acks the
longest finished run from the lowest open tag with one frame. A finished message behind an
unfinished one waits ``straggler_delay`` for it, then is acked on its own: a message held for long
(a requeue backing off, a retry) must not keep later ones unacked, since unacked messages fill the
prefetch window and the broker would stop delivering. Rejections always go out on their own.

Delivery tags belong to their channel. After a reconnect (aio-pika's robust channel opens a new
one) the old channel's deliveries can no longer be acked, and the broker redelivers them, so their
entries are dropped. The channel must carry no other consumer: a delivery this class never saw
would stop the run there (it is never covered by a multiple ack; later messages go one by one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field

import aiormq
from aio_pika.abc import AbstractIncomingMessage

logger = logging.getLogger(__name__)

STRAGGLER_DELAY = 0.05
"""Seconds a finished message waits for an unfinished one ahead of it; then it is acked alone."""


@dataclass
class _Delivery:
    message: AbstractIncomingMessage
    finished_at: float | None = None
    """Loop time its handling finished (its ack is due); None while it is handled."""
    settled: bool = False
    """Acked or rejected on its own."""


@dataclass
class _Channel:
    next_tag: int
    """The lowest tag not yet covered: the run a multiple ack covers starts here."""
    open: dict[int, _Delivery] = field(default_factory=dict)


class Acks:
    def __init__(self, straggler_delay: float = STRAGGLER_DELAY, before_ack: Callable[[], None] | None = None) -> None:
        self.straggler_delay = straggler_delay
        self.before_ack = before_ack
        """Called before each round of acks: the ingest client flushes the lines it wrote to its
        file, so no result is acked before its line is written out."""
        self._channels: dict[aiormq.abc.AbstractChannel, _Channel] = {}
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._straggler_due: float | None = None
        """Loop time at which the earliest finished message waiting behind an unfinished one is due
        to be acked alone (found by the last round; None: none waits)."""
        self.frames = 0
        """Ack frames sent (multiple or not), for tests and the curious."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="acks")

    def received(self, message: AbstractIncomingMessage) -> None:
        """Register a delivery as it arrives (before anything awaits), in delivery order."""
        tag = message.delivery_tag
        assert tag is not None, "a consumer's message has a delivery tag"
        key = message.channel
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = _Channel(next_tag=tag)
        channel.open[tag] = _Delivery(message)

    def finished(self, message: AbstractIncomingMessage) -> None:
        """Its outcome is confirmed: ack it (soon, with others where it can)."""
        delivery = self._find(message)
        if delivery is not None:
            delivery.finished_at = asyncio.get_running_loop().time()
            self._due.set()

    async def reject(self, message: AbstractIncomingMessage, *, requeue: bool) -> None:
        """Reject it now, on its own (nothing else is settled by a reject)."""
        delivery = self._find(message)
        if delivery is not None:
            delivery.settled = True
            self._due.set()  # the run may now pass it
        await message.reject(requeue=requeue)

    def _find(self, message: AbstractIncomingMessage) -> _Delivery | None:
        for channel in self._channels.values():
            delivery = channel.open.get(message.delivery_tag or 0)
            if delivery is not None and delivery.message is message:
                return delivery
        return None  # its channel was lost: the broker redelivers it

    async def _run(self) -> None:
        while True:
            due = (
                None
                if self._straggler_due is None
                else max(0.0, self._straggler_due - asyncio.get_running_loop().time())
            )
            with suppress(TimeoutError):
                async with asyncio.timeout(due):
                    await self._due.wait()
            self._due.clear()
            try:
                await self.flush()
            except Exception:  # acking must go on: a stopped acker would fill the prefetch window
                logger.exception("acks: a round of acks failed")

    async def flush(self, *, everything: bool = False) -> None:
        """Ack the finished runs; and finished stragglers that waited long enough (all of them
        with ``everything``: at shutdown)."""
        now = asyncio.get_running_loop().time()
        if self.before_ack is not None:
            self.before_ack()
        self._straggler_due = None
        for key, channel in list(self._channels.items()):
            if key.is_closed:  # its deliveries come back from the broker
                del self._channels[key]
                continue
            last = None
            while (delivery := channel.open.get(channel.next_tag)) is not None and (
                delivery.settled or delivery.finished_at is not None
            ):
                del channel.open[channel.next_tag]
                channel.next_tag += 1
                if not delivery.settled:
                    last = delivery
            alone, before_run = [], []  # one pass over what is left open
            for tag, delivery in channel.open.items():
                if not delivery.settled and delivery.finished_at is not None:
                    due = delivery.finished_at + self.straggler_delay
                    if everything or tag < channel.next_tag or due <= now:
                        delivery.settled = True
                        alone.append(delivery)
                    elif self._straggler_due is None or due < self._straggler_due:
                        self._straggler_due = due
                if delivery.settled and tag < channel.next_tag:
                    before_run.append(tag)  # before the run's start: never walked, settled alone
            for tag in before_run:
                del channel.open[tag]
            try:
                if last is not None:
                    await last.message.ack(multiple=True)
                    self.frames += 1
                for delivery in alone:
                    await delivery.message.ack()
                    self.frames += 1
            except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                logger.warning("acks: cannot ack on a lost channel (%s); the broker redelivers those messages", exc)
                self._channels.pop(key, None)

    async def aclose(self) -> None:
        """Ack everything finished, then stop (before the connection closes)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush(everything=True)
