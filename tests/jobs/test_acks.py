"""Acks with ``multiple=True`` (``service.jobs.acks``) against real RabbitMQ: what the broker holds
afterwards is the proof (a message acked by mistake would be missing, one never acked comes back
when the connection closes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from service.jobs.acks import Acks
from tests.jobs.conftest import BROKER_URL, queue_depth

pytestmark = pytest.mark.rabbitmq


@asynccontextmanager
async def consuming(
    name: str, count: int, prefetch: int, on_message: Callable[[AbstractIncomingMessage], None]
) -> AsyncIterator[AbstractQueue]:
    """``count`` messages published to a fresh queue ``name``, consumed with ``prefetch``; the
    connection is closed at the end (so what was not acked goes back to the queue)."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.declare_queue(name, durable=True)
        for i in range(count):
            await channel.default_exchange.publish(aio_pika.Message(str(i).encode()), name)

        async def handle(message: AbstractIncomingMessage) -> None:
            on_message(message)

        await queue.consume(handle)
        yield queue


class Taking:
    """A consumer's side: each delivery registered with ``acks`` and kept in ``got``."""

    def __init__(self, acks: Acks, finish_after_first: bool = False) -> None:
        self.acks, self.got = acks, list[AbstractIncomingMessage]()
        self.finish_after_first = finish_after_first
        acks.start()

    def __call__(self, message: AbstractIncomingMessage) -> None:
        self.acks.received(message)
        self.got.append(message)
        if self.finish_after_first and len(self.got) > 1:
            self.acks.finished(message)


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def finish_in_one_turn(acks: Acks, messages: list[AbstractIncomingMessage]) -> None:
    """Finish ``messages`` together and check that one ack frame settled them."""
    for message in messages:
        acks.finished(message)
    await until(lambda: acks.frames > 0)
    await asyncio.sleep(0.1)
    assert acks.frames == 1
    await acks.aclose()


async def test_a_run_of_finished_messages_is_acked_with_one_frame(prefix: str) -> None:
    """Twenty messages finished in one turn cost one ack frame, and none comes back."""
    taking = Taking(acks := Acks())
    got = taking.got
    async with consuming(f"{prefix}.acks", 20, 20, taking):
        await until(lambda: len(got) == 20)
        await finish_in_one_turn(acks, list(reversed(got)))  # the order they finish in does not matter
    assert await queue_depth(f"{prefix}.acks") == 0


async def test_a_held_message_does_not_keep_later_ones_unacked(prefix: str) -> None:
    """With prefetch 4 and the first message held, the later ones are acked alone after the
    straggler delay, so the broker keeps delivering (a stalled window would stop at 4); once the
    held one finishes too, nothing comes back."""
    taking = Taking(acks := Acks(straggler_delay=0.02), finish_after_first=True)
    got = taking.got
    async with consuming(f"{prefix}.acks", 10, 4, taking):
        await until(lambda: len(got) == 10)
        acks.finished(got[0])
        await acks.aclose()
    assert await queue_depth(f"{prefix}.acks") == 0


async def test_a_rejected_message_is_passed_over_and_comes_back(prefix: str) -> None:
    """Reject the fifth of ten with requeue: the nine others are acked with one frame past it, and
    only the rejected one is in the queue afterwards."""
    taking = Taking(acks := Acks())
    got = taking.got
    async with consuming(f"{prefix}.acks", 10, 10, taking):
        await until(lambda: len(got) == 10)
        acks.reject(got[4], requeue=True)
        await until(lambda: len(got) == 11)  # redelivered to us; left unfinished
        assert got[10].body == got[4].body
        await finish_in_one_turn(acks, got[:4] + got[5:10])
    assert await queue_depth(f"{prefix}.acks") == 1


async def test_finished_messages_of_a_lost_channel_are_left_to_the_broker(prefix: str) -> None:
    """After the channel is gone its delivery tags mean nothing: no ack is tried (no error), and
    the broker has every message back for redelivery."""
    taking = Taking(acks := Acks())
    got = taking.got
    async with consuming(f"{prefix}.acks", 5, 5, taking) as queue:
        await until(lambda: len(got) == 5)
        await queue.channel.close()
        for message in got:
            acks.finished(message)
        await acks.aclose()
        assert acks.frames == 0
    assert await queue_depth(f"{prefix}.acks") == 5


async def test_a_reject_delayed_on_its_way_out_is_not_covered_by_a_multiple_ack(prefix: str) -> None:
    """The fifth of ten is rejected with requeue in the same turn as the nine others finish, and
    its reject frame is held up on its way out (a full write queue: the patched ``basic_reject``
    yields to the loop before writing). The ack with ``multiple`` for the run must not leave first:
    the rejected message comes back. Before, the reject marked it settled at once, the acker's
    multiple ack covered its tag and deleted it, and the late reject closed the channel
    (PRECONDITION_FAILED, unknown delivery tag)."""
    taking = Taking(acks := Acks())
    got = taking.got
    async with consuming(f"{prefix}.acks", 10, 10, taking):
        await until(lambda: len(got) == 10)
        channel = got[4].channel
        send_reject = channel.basic_reject

        async def held_up_reject(delivery_tag: int, *, requeue: bool = True, wait: bool = True) -> None:
            for _ in range(10):
                await asyncio.sleep(0)  # the write queue is full: other tasks run first
            await send_reject(delivery_tag, requeue=requeue, wait=wait)

        channel.basic_reject = held_up_reject  # type: ignore[method-assign]
        for message in got[:4] + got[5:]:
            acks.finished(message)
        acks.reject(got[4], requeue=True)
        await until(lambda: len(got) == 11)  # redelivered; left unfinished
        assert got[10].body == got[4].body
        assert not channel.is_closed
        await acks.aclose()
    assert await queue_depth(f"{prefix}.acks") == 1
