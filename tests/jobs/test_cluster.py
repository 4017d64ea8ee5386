"""Offline mode on a three-node RabbitMQ cluster on this machine (``loadtests.harness.rabbitmq_cluster``):
the production policies, clients that move to a live node when theirs is killed, nothing lost."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from loadtests.harness.rabbitmq_cluster import RabbitCluster
from service.jobs.broker import Broker
from service.jobs.policies import gateway_policies, rabbitmqctl_commands
from service.jobs.topology import REQUEST_KEY, Names

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"cluster-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def cluster(prefix: str) -> Iterator[RabbitCluster]:
    policies = rabbitmqctl_commands(gateway_policies(Names(prefix), delivery_limit=5))
    with RabbitCluster(size=3) as cluster:
        for command in policies:
            cluster.ctl(cluster.nodes[0], *command[1:])
        yield cluster


def node_of(cluster: RabbitCluster, port: int) -> int:
    return next(i for i, node in enumerate(cluster.nodes) if node.amqp_port == port)


def test_three_nodes_form_one_cluster_with_the_gateway_policies(cluster: RabbitCluster, prefix: str) -> None:
    names = [node.name for node in cluster.nodes]
    for node in cluster.nodes:
        assert cluster.members(node) == sorted(names)
    listed = json.loads(cluster.ctl(cluster.nodes[1], "list_policies", "--formatter", "json"))  # another node
    definitions = {p["name"]: json.loads(p["definition"]) for p in listed}
    assert definitions[f"{prefix}-work"] == {"delivery-limit": 5, "dead-letter-exchange": f"{prefix}.dead"}


async def test_a_client_moves_to_a_live_node_when_its_node_is_killed(cluster: RabbitCluster, prefix: str) -> None:
    """Publisher and consumer on one Broker given every node: its node SIGKILLed, it reconnects to
    another, its consumer is back, and publishes are confirmed again; nothing confirmed is lost."""
    names = Names(f"{prefix}-move")
    received: list[bytes] = []

    async def consume(broker: Broker) -> None:
        assert broker.topology is not None

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(message.body)
            await message.ack()

        await broker.topology.requests_queue.consume(on_message)

    broker = Broker(cluster.urls, names, publish_timeout=5, on_connect=consume)
    await broker.connect(timeout=30)
    try:
        first = node_of(cluster, int(broker.url.rsplit(":", 1)[1].strip("/")))
        confirmed: list[bytes] = []
        for i in range(20):
            body = f"before-{i}".encode()
            await broker.publish("requests", aio_pika.Message(body, delivery_mode=2), REQUEST_KEY)
            confirmed.append(body)
        cluster.kill(cluster.nodes[first])
        killed = asyncio.get_running_loop().time()
        async with asyncio.timeout(60):
            i = 0
            while len(confirmed) < 40:
                body = f"after-{i}".encode()
                try:
                    await broker.publish("requests", aio_pika.Message(body, delivery_mode=2), REQUEST_KEY)
                    confirmed.append(body)
                    i += 1
                except Exception:  # 503 while it moves: the caller retries, as the API's clients do
                    await asyncio.sleep(0.1)
        moved_after = asyncio.get_running_loop().time() - killed
        assert node_of(cluster, int(broker.url.rsplit(":", 1)[1].strip("/"))) != first
        async with asyncio.timeout(60):
            while not set(confirmed) <= set(received):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        print(f"reconnected and publishing {moved_after:.1f} s after the SIGKILL")
    finally:
        await broker.aclose()
        cluster.start_node(cluster.nodes[first])
