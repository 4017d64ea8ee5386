"""Exchange and queue names, and their declaration (idempotent; every party declares what it uses).

<prefix>.requests  direct exchange -> quorum queue <prefix>.work        (routing key "classify")
<prefix>.results   topic exchange  -> quorum queue <prefix>.results     (binding "#", capped)
                                   -> each API replica's own queue      (binding "jobs")
                                   -> each ingest run's quorum queue    (binding "ingest.<run>")
<prefix>.dead      fanout exchange -> quorum queue <prefix>.dead        (reason in x-gateway-error,
                                                                         or x-death for the broker's)
(default exchange)                 -> quorum queue <prefix>.webhooks    (deliveries to make)
                                   -> quorum queues <prefix>.webhooks.retry.<ms>ms (deliveries to retry:
                                      dead-lettered back to <prefix>.webhooks when their TTL expires;
                                      see ``service.jobs.webhooks``)

Queues are declared with no arguments but their type: the delivery limit, dead-letter exchange and
length caps come from RabbitMQ policies (``service.jobs.policies``), which can change on a live
queue, where a changed queue argument fails every later declaration with PRECONDITION_FAILED.

Migration from the classic ``<prefix>.requests`` queue of earlier versions (a classic queue cannot
become a quorum queue in place): ``migrate_legacy`` unbinds it, so new jobs reach only the quorum
queue, moves what it holds there (each message confirmed before it is acked), and deletes it once
empty. Workers run it at start and every minute, so a rolling upgrade loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue

from service.jobs.messages import copy_message

REQUEST_KEY = "classify"


@dataclass(frozen=True)
class Names:
    prefix: str

    @property
    def requests(self) -> str:
        return f"{self.prefix}.requests"

    @property
    def work(self) -> str:
        """The quorum queue workers consume."""
        return f"{self.prefix}.work"

    @property
    def legacy_requests(self) -> str:
        """The classic queue of earlier versions, migrated by ``migrate_legacy``."""
        return f"{self.prefix}.requests"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dead(self) -> str:
        return f"{self.prefix}.dead"

    @property
    def idempotency(self) -> str:
        """The stream of idempotency claims API replicas share (``service.jobs.idempotency``)."""
        return f"{self.prefix}.idempotency"

    @property
    def webhooks(self) -> str:
        """The quorum queue of webhook deliveries (``service.jobs.webhooks``)."""
        return f"{self.prefix}.webhooks"

    def webhook_retry(self, delay_ms: int) -> str:
        """The queue where a delivery waits ``delay_ms`` before its next attempt."""
        return f"{self.prefix}.webhooks.retry.{delay_ms}ms"

    def ingest_queue(self, run: str) -> str:
        return f"{self.prefix}.ingest.{run}"


@dataclass
class Topology:
    names: Names
    requests_exchange: AbstractExchange
    requests_queue: AbstractQueue
    results_exchange: AbstractExchange
    dead_exchange: AbstractExchange
    dead_queue: AbstractQueue


async def declare(connection: AbstractConnection, channel: AbstractChannel, names: Names) -> Topology:
    requests_exchange = await channel.declare_exchange(names.requests, aio_pika.ExchangeType.DIRECT, durable=True)
    results_exchange = await channel.declare_exchange(names.results, aio_pika.ExchangeType.TOPIC, durable=True)
    dead_exchange = await channel.declare_exchange(names.dead, aio_pika.ExchangeType.FANOUT, durable=True)
    requests_queue = await channel.declare_queue(names.work, durable=True, arguments={"x-queue-type": "quorum"})
    await requests_queue.bind(requests_exchange, REQUEST_KEY)
    # Quorum queues, replicated over a cluster's nodes: a classic queue lives on one node, and a
    # client that fails over could not even declare it while that node is down. A queue an earlier
    # version made classic is used as it is.
    results_queue = await declare_replicated(connection, channel, names.results)
    await results_queue.bind(results_exchange, "#")
    dead_queue = await declare_replicated(connection, channel, names.dead)
    await dead_queue.bind(dead_exchange)
    await channel.declare_queue(names.webhooks, durable=True, arguments={"x-queue-type": "quorum"})
    return Topology(names, requests_exchange, requests_queue, results_exchange, dead_exchange, dead_queue)


async def declare_replicated(connection: AbstractConnection, channel: AbstractChannel, name: str) -> AbstractQueue:
    """A durable quorum queue, or the queue of that name as an earlier version declared it."""
    if await _exists(connection, name):
        return await channel.declare_queue(name, durable=True, passive=True)
    return await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})


async def _exists(connection: AbstractConnection, name: str) -> bool:
    """Whether a queue exists (asked on a channel of its own: a failed passive declare closes it).
    An existing results queue is used as it is, whatever arguments an earlier version gave it."""
    probe = await connection.channel()
    try:
        await probe.declare_queue(name, passive=True)
        return True
    except aio_pika.exceptions.ChannelClosed:
        return False
    finally:
        if not probe.is_closed:
            await probe.close()


async def migrate_legacy(connection: AbstractConnection, names: Names) -> int:
    """Move the jobs of the classic ``<prefix>.requests`` queue into the quorum queue; return how
    many were moved. Nothing to do (0) when that queue does not exist."""
    channel = await connection.channel(publisher_confirms=True)
    try:
        try:
            legacy = await channel.declare_queue(names.legacy_requests, passive=True)
        except aio_pika.exceptions.ChannelClosed:
            return 0
        exchange = await channel.get_exchange(names.requests)
        await legacy.unbind(exchange, REQUEST_KEY)
        moved = 0
        while (message := await legacy.get(fail=False, no_ack=False)) is not None:
            copy = copy_message(message, message.headers or {}, timestamp=message.timestamp)
            await exchange.publish(copy, REQUEST_KEY, mandatory=True)
            await message.ack()
            moved += 1
        await legacy.delete(if_unused=False, if_empty=True)
        return moved
    finally:
        if not channel.is_closed:
            await channel.close()
