"""Several broker addresses (the nodes of a cluster): how they are read, refused, and tried."""

from __future__ import annotations

import random
import socket

import pytest
from pydantic import ValidationError

from service.jobs.broker import Backoff, Broker, addresses
from service.jobs.topology import Names
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL

pytestmark = pytest.mark.rabbitmq


def test_backoff_doubles_to_its_cap_with_jitter() -> None:
    random.seed(7)
    backoff = Backoff(first=0.5, cap=10.0)
    delays = [backoff.next() for _ in range(10)]
    for attempt, delay in enumerate(delays):
        base = min(10.0, 0.5 * 2**attempt)
        assert 0.5 * base <= delay < 1.5 * base
    assert len({round(d, 6) for d in delays}) == len(delays)  # drawn, not in step with other clients
    backoff.reset()
    assert backoff.next() < 0.75


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("http://h/", "broker address 1 of 1 is not an amqp:// or amqps:// URL"),
        ("amqp://u:pw@h1/,", "broker address 2 of 2 is empty"),
        ("amqp://h1/,,amqp://h2/", "broker address 2 of 3 is empty"),
        ("amqp://u:pw@h:99999/", "broker address 1 of 1 is not a URL"),
        ("amqp://u:pw@/", "broker address 1 of 1 has no host"),
        ("amqp://u:pw@h1/,amqp://h 2/", "broker address 2 of 2 has no host, or a space"),
        ("amqp://u:pw@h1/\n", None),  # surrounding blanks are trimmed
        (",".join(["amqp://h/"] * 17), "17 broker addresses; at most 16"),
    ],
)
def test_broker_addresses_are_checked_one_by_one_without_echoing_them(value: str, says: str | None) -> None:
    if says is None:
        assert Settings(broker_url=value).broker_url == value.strip()
        return
    with pytest.raises(ValidationError) as refused:
        Settings(broker_url=value)
    assert says in str(refused.value)
    assert "pw" not in str(refused.value)


def test_addresses_are_split_and_trimmed() -> None:
    assert addresses(" amqp://a/ , amqps://b:5671/ ") == ["amqp://a/", "amqps://b:5671/"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_dead_address_is_passed_over_for_a_live_one(prefix: str) -> None:
    """Whichever address a process starts on, it ends up connected to the one that answers."""
    dead = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/"
    for _ in range(3):  # the start is random: both orders get tried
        broker = Broker(f"{dead},{BROKER_URL}", Names(prefix))
        try:
            await broker.connect(timeout=20)
            assert broker.is_open
            assert broker.url == BROKER_URL
            assert broker.status() == "ok"
        finally:
            await broker.aclose()
