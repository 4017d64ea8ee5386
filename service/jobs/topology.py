"""Exchange and queue names, and their declaration (idempotent; every party declares what it uses).

<prefix>.requests  direct exchange -> durable queue <prefix>.requests   (routing key "classify")
<prefix>.results   topic exchange  -> durable queue <prefix>.results    (binding "#", capped)
                                   -> each API replica's own queue      (binding "#")
                                   -> each ingest run's durable queue   (binding "ingest.<run>")
<prefix>.dead      fanout exchange -> durable queue <prefix>.dead       (reason in x-gateway-error)
"""

from __future__ import annotations

from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

REQUEST_KEY = "classify"
RESULTS_CAP = 1_000_000


@dataclass(frozen=True)
class Names:
    prefix: str

    @property
    def requests(self) -> str:
        return f"{self.prefix}.requests"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dead(self) -> str:
        return f"{self.prefix}.dead"

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


async def declare(channel: AbstractChannel, names: Names) -> Topology:
    requests_exchange = await channel.declare_exchange(names.requests, aio_pika.ExchangeType.DIRECT, durable=True)
    results_exchange = await channel.declare_exchange(names.results, aio_pika.ExchangeType.TOPIC, durable=True)
    dead_exchange = await channel.declare_exchange(names.dead, aio_pika.ExchangeType.FANOUT, durable=True)
    requests_queue = await channel.declare_queue(
        names.requests, durable=True, arguments={"x-dead-letter-exchange": names.dead}
    )
    await requests_queue.bind(requests_exchange, REQUEST_KEY)
    results_queue = await channel.declare_queue(
        names.results, durable=True, arguments={"x-max-length": RESULTS_CAP, "x-overflow": "drop-head"}
    )
    await results_queue.bind(results_exchange, "#")
    dead_queue = await channel.declare_queue(names.dead, durable=True)
    await dead_queue.bind(dead_exchange)
    return Topology(names, requests_exchange, requests_queue, results_exchange, dead_exchange, dead_queue)
