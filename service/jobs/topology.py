"""Exchange and queue names, and their declaration (idempotent; every party declares what it uses).

<prefix>.requests  direct exchange -> quorum queue <prefix>.work        (routing key "classify": the
                                                                         default model's jobs)
                                   -> quorum queue <prefix>.work.<model> (routing key "classify.<model>":
                                                                         each other model's jobs, and
                                                                         the default model's queued
                                                                         while another was the default)
<prefix>.results   topic exchange  -> quorum queue <prefix>.results     (binding "#", capped)
                                   -> each API replica's own queue      (binding "jobs")
                                   -> each ingest run's quorum queue    (binding "ingest.<run>",
                                      <prefix>.ingest.<run>: expires once unused)
<prefix>.dead      fanout exchange -> quorum queue <prefix>.dead        (reason in x-gateway-error,
                                                                         or x-death for the broker's)
<prefix>.notices   topic exchange  -> each API replica's own queue      (binding "jobs": why a job is
                                                                         still waiting, JobNotice)
(default exchange)                 -> quorum queue <prefix>.webhooks    (deliveries to make)
                                   -> quorum queues <prefix>.webhooks.retry.<ms>ms (deliveries to retry:
                                      dead-lettered back to <prefix>.webhooks when their TTL expires;
                                      see ``service.jobs.webhooks``)

The work queues are declared with no arguments but their type: the delivery limit and dead-letter
exchange come from RabbitMQ policies (``service.jobs.policies``), which can change on a live queue,
where a changed queue argument fails every later declaration with PRECONDITION_FAILED. Two queues
would otherwise grow without bound where nobody applies the policies (the quick start does not),
so the gateway declares their bounds itself, as arguments: ``<prefix>.results`` is capped
(``x-max-length``, ``x-overflow: drop-head``: the oldest results go first), and each ingest run's
queue expires once unused (``x-expires``: an interrupted run that is never rerun). A queue of the
same name declared by an earlier version without them is used as it is (``declare_replicated``,
with a warning): its bounds then come from the policies, which cover it too.

Migration from the classic ``<prefix>.requests`` queue of earlier versions (a classic queue cannot
become a quorum queue in place): ``migrate_legacy`` unbinds it, so new jobs reach only the quorum
queue, moves what it holds there (each message confirmed before it is acked), and deletes it once
empty. Workers run it at start and every minute, so a rolling upgrade loses nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue

from service.jobs.messages import copy_message

logger = logging.getLogger(__name__)

REQUEST_KEY = "classify"
INGEST_REPLY = re.compile(r"ingest\.[0-9a-f]{16}")
"""The ``reply_to`` of an ingest run's jobs (``service.jobs.ingest.run_id``)."""
RESULTS_CAP = 1_000_000
"""Results kept in ``<prefix>.results`` (the oldest dropped beyond it)."""
RESULTS_ARGUMENTS = {"x-max-length": RESULTS_CAP, "x-overflow": "drop-head"}


def ingest_arguments(expires: float) -> dict[str, int]:
    """The arguments of an ingest run's results queue: deleted by the broker once unused for
    ``expires`` seconds (no consumer, not declared again)."""
    return {"x-expires": max(1, round(expires * 1000))}


@dataclass(frozen=True)
class Route:
    """Where one model's jobs go: a quorum queue, bound to the requests exchange with its key. A
    queue per model: a flood of one model's jobs waits in its own queue, workers serve the models
    they are given, and an autoscaler can size each model's workers on its own queue's depth."""

    model: str
    queue: str
    key: str


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
    def notices(self) -> str:
        """The exchange of notices about jobs still waiting (``service.jobs.messages.JobNotice``)."""
        return f"{self.prefix}.notices"

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

    def ingest_run(self, reply_to: str) -> str | None:
        """The results queue of the ingest run a job's ``reply_to`` names (``ingest.<run>``), or None."""
        return self.ingest_queue(reply_to[7:]) if INGEST_REPLY.fullmatch(reply_to) else None

    def route(self, model: str, default: str) -> Route:
        """The queue and routing key of ``model``'s jobs. The default model keeps the queue and key
        of the versions that served one model (``<prefix>.work``, ``classify``), so a gateway that
        serves one model, and its queued jobs, stay as they were."""
        if model == default:
            return Route(model, self.work, REQUEST_KEY)
        return self._own_route(model)

    def _own_route(self, model: str) -> Route:
        """The queue of ``model`` when it is not the default: ``<prefix>.work.<model>``."""
        return Route(model, f"{self.work}.{model}", f"{REQUEST_KEY}.{model}")

    def routes(self, models: Iterable[str], default: str) -> list[Route]:
        return [self.route(model, default) for model in models]

    def queues(self, models: Iterable[str], default: str) -> list[Route]:
        """Every queue where jobs of ``models`` wait: each one's route, and for the default model
        also ``<prefix>.work.<model>``, its queue while another model was the default. Its jobs
        queued then wait there (and an API replica still on the old models file sends more there
        during a rolling update), so a worker consumes both queues of the default model, and no
        job is stranded when the models file's ``default`` changes."""
        found: list[Route] = []
        for model in models:
            found.append(self.route(model, default))
            if model == default:
                found.append(self._own_route(model))
        return found


@dataclass
class Topology:
    names: Names
    requests_exchange: AbstractExchange
    requests_queue: AbstractQueue
    """The default model's queue, ``<prefix>.work``."""
    work_queues: dict[str, AbstractQueue]
    """Every declared model queue by name, ``<prefix>.work`` included."""
    results_exchange: AbstractExchange
    dead_exchange: AbstractExchange
    dead_queue: AbstractQueue
    notices_exchange: AbstractExchange


async def declare(
    connection: AbstractConnection, channel: AbstractChannel, names: Names, routes: Iterable[Route] = ()
) -> Topology:
    """Declare the topology, with a work queue for each of ``routes`` besides ``<prefix>.work``."""
    requests_exchange = await channel.declare_exchange(names.requests, aio_pika.ExchangeType.DIRECT, durable=True)
    results_exchange = await channel.declare_exchange(names.results, aio_pika.ExchangeType.TOPIC, durable=True)
    dead_exchange = await channel.declare_exchange(names.dead, aio_pika.ExchangeType.FANOUT, durable=True)
    notices_exchange = await channel.declare_exchange(names.notices, aio_pika.ExchangeType.TOPIC, durable=True)
    work_queues: dict[str, AbstractQueue] = {}
    for queue, key in {names.work: REQUEST_KEY, **{route.queue: route.key for route in routes}}.items():
        work_queues[queue] = await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        await work_queues[queue].bind(requests_exchange, key)
    requests_queue = work_queues[names.work]
    # Quorum queues, replicated over a cluster's nodes: a classic queue lives on one node, and a
    # client that fails over could not even declare it while that node is down. A queue an earlier
    # version made classic is used as it is.
    results_queue = await declare_replicated(connection, channel, names.results, RESULTS_ARGUMENTS)
    await results_queue.bind(results_exchange, "#")
    dead_queue = await declare_replicated(connection, channel, names.dead)
    await dead_queue.bind(dead_exchange)
    await channel.declare_queue(names.webhooks, durable=True, arguments={"x-queue-type": "quorum"})
    return Topology(
        names,
        requests_exchange,
        requests_queue,
        work_queues,
        results_exchange,
        dead_exchange,
        dead_queue,
        notices_exchange,
    )


async def declare_replicated(
    connection: AbstractConnection, channel: AbstractChannel, name: str, arguments: Mapping[str, Any] | None = None
) -> AbstractQueue:
    """A durable quorum queue with ``arguments``, or the queue of that name as an earlier version
    declared it (classic, or without these arguments: RabbitMQ refuses a declaration whose
    arguments differ, so it is tried on a channel of its own first)."""
    wanted = {"x-queue-type": "quorum", **(arguments or {})}
    probe = await connection.channel()
    try:
        await probe.declare_queue(name, durable=True, arguments=wanted)
    except aio_pika.exceptions.ChannelClosed as exc:  # PRECONDITION_FAILED: it exists, otherwise
        if arguments:
            logger.warning(
                "topology: queue %s exists without %s (%s); it is used as it is, bounded only by the "
                "policies (gateway queues policies --apply)",
                name,
                ", ".join(f"{key}={value}" for key, value in arguments.items()),
                exc,
            )
        return await channel.declare_queue(name, durable=True, passive=True)
    finally:  # closed even when the broker closed it: a robust channel would reopen itself
        with suppress(Exception):
            await probe.close()
    return await channel.declare_queue(name, durable=True, arguments=wanted)


async def queue_exists(connection: AbstractConnection, name: str) -> bool:
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
