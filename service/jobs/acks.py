"""Acknowledge a consumer's messages with ``multiple=True``: one frame for many.

A worker finishes its messages out of order (batches, publish confirms), and acks each only once
its outcome is confirmed. An ack with ``multiple`` settles every delivery up to its tag, so it may
only be sent for a tag whose every predecessor on the channel is finished too. :class:`Acks` keeps
each channel's deliveries by tag; once per event-loop turn in which messages finished, it acks the
longest finished run from the lowest open tag with one frame. A finished message behind an
unfinished one waits ``straggler_delay`` for it, then is acked on its own: a message held for long
(a requeue backing off, a retry) must not keep later ones unacked, since unacked messages fill the
prefetch window and the broker would stop delivering.

Rejections are sent by the same task, in the same round, before that round's acks. Frames of one
channel must leave in order: a ``multiple`` ack settles every delivery up to its tag that is still
outstanding at the broker, so a reject sent after it (by another task, whose write waited on a full
write queue) would find its message already acked, deleted instead of requeued. So :meth:`reject`
only marks the delivery, and the acker sends its reject frame ahead of any ack that could cover it;
a multiple ack never passes a delivery that is neither finished nor rejected. The acker stops only
between rounds (:meth:`aclose`), never in the middle of one.

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
    requeue: bool | None = None
    """Set by ``reject``: its reject frame is due (requeue or not); None: not rejected."""
    settled: bool = False
    """Acked or rejected on its own (its frame is sent, or being sent, by the acker)."""


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
        self._closing = False
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

    def reject(self, message: AbstractIncomingMessage, *, requeue: bool) -> None:
        """Reject it (alone: nothing else is settled by a reject) in the acker's next round, before
        any ack that could cover it. Nothing to do when its channel is lost: the broker redelivers it."""
        delivery = self._find(message)
        if delivery is not None and delivery.requeue is None and delivery.finished_at is None:
            delivery.requeue = requeue
            self._due.set()  # the run may now pass it, once its frame is out

    def _find(self, message: AbstractIncomingMessage) -> _Delivery | None:
        for channel in self._channels.values():
            delivery = channel.open.get(message.delivery_tag or 0)
            if delivery is not None and delivery.message is message:
                return delivery
        return None  # its channel was lost: the broker redelivers it

    async def _run(self) -> None:
        while not self._closing:
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
                await self.flush(everything=self._closing)
            except Exception:  # acking must go on: a stopped acker would fill the prefetch window
                logger.exception("acks: a round of acks failed")

    async def flush(self, *, everything: bool = False) -> None:
        """Reject what was rejected, then ack the finished runs; and finished stragglers that waited
        long enough (all of them with ``everything``: at shutdown). Only the acker calls it (or
        ``aclose`` once the acker is gone): two rounds at once could reorder frames."""
        now = asyncio.get_running_loop().time()
        if self.before_ack is not None:
            self.before_ack()
        self._straggler_due = None
        for key, channel in list(self._channels.items()):
            if key.is_closed:  # its deliveries come back from the broker
                del self._channels[key]
                continue
            rejects, last, alone = self._round(channel, now, everything)
            try:
                for delivery in rejects:  # first: the multiple ack below may cover their tags
                    await delivery.message.reject(requeue=bool(delivery.requeue))
                if last is not None:
                    await last.message.ack(multiple=True)
                    self.frames += 1
                for delivery in alone:
                    await delivery.message.ack()
                    self.frames += 1
            except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                logger.warning("acks: cannot settle on a lost channel (%s); the broker redelivers those messages", exc)
                self._channels.pop(key, None)

    def _round(
        self, channel: _Channel, now: float, everything: bool
    ) -> tuple[list[_Delivery], _Delivery | None, list[_Delivery]]:
        """What one round sends on ``channel``: the rejects due (in tag order), the last finished
        delivery of the run from the lowest open tag (acked with ``multiple``), and the finished
        deliveries to ack alone. Each is marked settled and the run's entries are dropped."""
        rejects: list[_Delivery] = []
        last = None
        while (delivery := channel.open.get(channel.next_tag)) is not None and (
            delivery.settled or delivery.finished_at is not None or delivery.requeue is not None
        ):
            del channel.open[channel.next_tag]
            channel.next_tag += 1
            if delivery.settled:
                continue
            delivery.settled = True
            if delivery.requeue is not None:
                rejects.append(delivery)
            else:
                last = delivery
        alone, before_run = [], []  # one pass over what is left open
        for tag, delivery in channel.open.items():
            if delivery.settled:
                pass
            elif delivery.requeue is not None:
                delivery.settled = True
                rejects.append(delivery)
            elif delivery.finished_at is not None:
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
        rejects.sort(key=lambda d: d.message.delivery_tag or 0)
        return rejects, last, alone

    async def aclose(self) -> None:
        """Settle everything finished or rejected, then stop (before the connection closes). The
        acker finishes its round in progress and makes the last one itself: cancelled in the middle
        of a round, it could leave a reject unsent that a later ack would cover."""
        self._closing = True
        if self._task is not None:
            self._due.set()
            await self._task
            self._task = None
        await self.flush(everything=True)
