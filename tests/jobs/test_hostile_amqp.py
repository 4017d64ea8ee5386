"""Hostile AMQP messages delivered to a real worker through the real RabbitMQ: bodies that are not
images, wrong or missing properties, headers of the wrong type, of absurd size or depth, values the
client library cannot decode, forged delivery counts. Each is answered as the design says (done, or
a ``failed`` result with a dead-letter copy: ``service.jobs.worker``), the good jobs between them
are classified, and the worker neither crashes nor loses its connection. The paths covered elsewhere
are not repeated here: a body that is not an image (test_offline), backend failures and NaN scores,
crash loops and the delivery-limit policy (test_worker_faults)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pytest
from pamqp import commands
from pamqp.encode import table_integer

from service.backends.fake import FakeBackend
from service.jobs.messages import (
    DROPPED_HEADER,
    ERROR_HEADER,
    PUBLISHED_HEADER,
    UNDECODABLE_HEADER,
    request_message,
)
from service.jobs.topology import REQUEST_KEY, Names, declare
from service.jobs.worker import run_worker
from service.settings import Settings
from tests.conftest import crafted_png, png_bytes, solid_image
from tests.jobs.conftest import BROKER_URL, collect_results, drain, queue_depth

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
FRAME_MAX = 131_072
"""RabbitMQ's default frame_max: a message's properties must fit in one frame of this size."""


class Raw:
    """A property value sent as these bytes, as they are: what a Python client would refuse to encode."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class RawProperties(commands.Basic.Properties):
    def encode_property(self, name: str, value: Any) -> bytes:
        return value.data if isinstance(value, Raw) else super().encode_property(name, value)


def raw_table(*entries: tuple[str, bytes]) -> Raw:
    """A header table of (name, type byte + encoded value) entries."""
    data = b"".join(bytes([len(name)]) + name.encode() + value for name, value in entries)
    return Raw(struct.pack(">I", len(data)) + data)


def byte_array(data: bytes) -> bytes:
    return b"x" + struct.pack(">I", len(data)) + data


TOP_K_1 = ("top_k", table_integer(1))


def deep_table(depth: int) -> Raw:
    """A header table nested ``depth`` deep: {"a": {"a": ... {}}}."""
    payload = struct.pack(">I", 0)
    for _ in range(depth):
        entry = b"\x01aF" + payload
        payload = struct.pack(">I", len(entry)) + entry
    return Raw(payload)


@dataclass
class Case:
    """One hostile message, and what must come of it: ``status`` of its result, and ``error`` (its
    reason, also on its dead-letter copy) when failed."""

    name: str
    body: bytes
    properties: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, Any] | Raw | None = None
    status: str = "done"
    error: str | None = None


def pixel(value: int = 7) -> bytes:
    return png_bytes(solid_image(value, 8))


CASES = [
    Case(
        "json-body",
        b'{"url": "http://example.com/cat.jpg"}',
        {"content_type": "application/json"},
        {"top_k": 1},
        "failed",
        "bad_image",
    ),
    Case("empty-body", b"", {}, {"top_k": 1}, "failed", "bad_image"),
    Case("truncated-png", pixel()[:40], {}, {"top_k": 1}, "failed", "bad_image"),
    Case("jpeg-magic-then-noise", b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8, {}, {"top_k": 1}, "failed", "bad_image"),
    Case("wrong-content-type", pixel(), {"content_type": "text/html; charset=utf-8"}, {"top_k": 1}),
    Case("decoder-budget", crafted_png(100_000, 100_000), {}, {"top_k": 1}, "failed", "payload_too_large"),
    Case("top-k-word", pixel(), {}, {"top_k": "many"}, "failed", "bad_request"),
    Case("top-k-table", pixel(), {}, {"top_k": {"k": 1}}, "failed", "bad_request"),
    Case("top-k-bool", pixel(), {}, {"top_k": True}, "failed", "bad_request"),
    Case("top-k-float", pixel(), {}, {"top_k": 2.5}, "failed", "bad_request"),
    Case("top-k-huge", pixel(), {}, {"top_k": 2**62}, "failed", "bad_request"),
    Case("top-k-bytes", pixel(), {}, raw_table(("top_k", byte_array(b"\xff\xfe"))), "failed", "bad_request"),
    Case("retries-word", pixel(), {}, {"top_k": 1, "x-retries": "lots"}, "failed", "bad_request"),
    Case("retries-negative", pixel(), {}, {"top_k": 1, "x-retries": -1_000_000}, "failed", "bad_request"),
    Case("retries-beyond-count", pixel(), {}, {"top_k": 1, "x-retries": 2**40}, "failed", "bad_request"),
    Case("retries-at-the-limit", pixel(), {}, {"top_k": 1, "x-retries": 3}),
    Case("requeues-negative", pixel(), {}, {"top_k": 1, "x-requeues": -3059}, "failed", "bad_request"),
    Case("requeues-word", pixel(), {}, {"top_k": 1, "x-requeues": "lots"}, "failed", "bad_request"),
    Case("requeues-beyond-count", pixel(), {}, {"top_k": 1, "x-requeues": 2**62}, "failed", "bad_request"),
    Case("requeues-some", pixel(), {}, {"top_k": 1, "x-requeues": 40}),
    Case("delivery-count-negative", pixel(), {}, {"top_k": 1, "x-delivery-count": -1}, "failed", "bad_request"),
    Case("top-k-zero", pixel(), {}, {"top_k": 0}, "failed", "bad_request"),
    Case("top-k-negative", pixel(), {}, {"top_k": -2}, "failed", "bad_request"),
    Case("top-k-21", pixel(), {}, {"top_k": 21}, "failed", "bad_request"),
    Case("filename-bytes", pixel(), {}, raw_table(TOP_K_1, ("filename", byte_array(b"\xff\xfe.png")))),
    Case("unknown-model", pixel(), {}, {"top_k": 1, "model": "resnet-9000"}),
    Case("published-ms-negative", pixel(), {}, {"top_k": 1, PUBLISHED_HEADER: -5}),
    Case("published-ms-word", pixel(), {}, {"top_k": 1, PUBLISHED_HEADER: "soon"}),
    Case("published-ms-tiny-float", pixel(), {}, {"top_k": 1, PUBLISHED_HEADER: 1.5}),
    Case("published-ms-double", pixel(), {}, raw_table(TOP_K_1, (PUBLISHED_HEADER, b"d" + struct.pack(">d", 1e300)))),
    Case("published-ms-future", pixel(), {}, {"top_k": 1, PUBLISHED_HEADER: 2**62}),
    Case("published-ms-bool", pixel(), {}, {"top_k": 1, PUBLISHED_HEADER: True}),
    Case("forged-delivery-count", pixel(), {}, {"top_k": 1, "x-delivery-count": 99}, "failed", "delivery_limit"),
    Case("huge-header", pixel(), {}, {"top_k": 1, "x-junk": "j" * 100_000}),
    Case(
        "huge-header-and-bad-body", b"nope", {}, {"top_k": 1, "x-junk": "j" * (FRAME_MAX - 100)}, "failed", "bad_image"
    ),
    Case(
        "double-header-and-bad-body",
        b"nope",
        {},
        raw_table(TOP_K_1, ("x-big", b"d" + struct.pack(">d", 1e300))),
        "failed",
        "bad_image",
    ),
    Case(
        "non-utf8-header-and-bad-body",
        b"nope",
        {},
        raw_table(TOP_K_1, ("x-text", b"S" + struct.pack(">I", 2) + b"\xff\xfe")),
        "failed",
        "bad_image",
    ),
    Case("timestamp-past-datetime", pixel(), {"timestamp": Raw(struct.pack(">Q", 2**64 - 1))}, {"top_k": 1}),
    Case(
        "timestamp-header-past-datetime",
        pixel(),
        {},
        raw_table(TOP_K_1, ("at", b"T" + struct.pack(">Q", 2**64 - 1))),
    ),
    Case(
        "webhook-url-128k",
        pixel(),
        {},
        {"top_k": 1, "x-webhook-url": "https://e.com/" + "w" * (FRAME_MAX - 400)},
        "failed",
        "bad_request",
    ),
    Case("headers-3000-deep", pixel(), {"message_id": None}, deep_table(3000), "failed", "bad_request"),
    Case("no-properties-at-all", pixel(), {"message_id": None, "reply_to": None, "timestamp": None}),
]
OUT_OF_RANGE = {
    "retries-negative": "x-retries",
    "retries-beyond-count": "x-retries",
    "requeues-negative": "x-requeues",
    "requeues-word": "x-requeues",
    "requeues-beyond-count": "x-requeues",
    "delivery-count-negative": "x-delivery-count",
    "top-k-zero": "top_k",
    "top-k-negative": "top_k",
    "top-k-21": "top_k",
}
"""Cases of a numeric header out of its range (or not a number), and the header."""
NAMELESS = {"headers-3000-deep", "no-properties-at-all"}
"""Cases without a message id: their results get a new job id."""


async def publish_raw(names: Names, cases: list[Case], good: list[aio_pika.Message]) -> None:
    """Declare the topology, then publish each case with its properties as given (encoded raw where
    a client would refuse), a good job after each."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await declare(connection, channel, names)
        underlay = await channel.get_underlay_channel()
        for case, job in zip(cases, good, strict=True):
            properties: dict[str, Any] = {
                "message_id": case.name,
                "reply_to": "jobs",
                "delivery_mode": 2,
                "timestamp": datetime.now(UTC),
            }
            properties.update(case.properties)
            if case.headers is not None:
                properties["headers"] = case.headers
            await underlay.basic_publish(
                case.body, exchange=names.requests, routing_key=REQUEST_KEY, properties=RawProperties(**properties)
            )
            await (await channel.get_exchange(names.requests, ensure=False)).publish(job, REQUEST_KEY)


def good_job(value: int) -> aio_pika.Message:
    return request_message(
        pixel(value), job_id=f"good-{value}", content_type="image/png", filename=None, top_k=1, reply_to="jobs"
    )


async def test_hostile_messages_get_their_answer_and_the_good_ones_flow(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """Each case of ``CASES``, a good job after each, one worker: every case ends as its row says
    (a failed one also has its dead-letter copy, under the same id, with the reason), every good
    job is done with its class, nothing is left in the queue, and the worker kept one connection.
    Before, a timestamp past ``datetime`` or a header table 3,000 deep closed the worker's
    connection in pamqp's decoder at every delivery (no result ever came), so did the dead-letter
    copy of a message whose headers filled a frame (RabbitMQ: frame_too_large), a wrong ``x-retries``
    was reported as a bad ``top_k``, and ``x-published-ms`` did not exist."""
    names = Names(prefix)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, backend="fake")
    good = [good_job(v) for v in range(len(CASES))]
    await publish_raw(names, CASES, good)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    try:
        results = await collect_results(names, 2 * len(CASES), timeout=60)
        assert not worker.done()
    finally:
        stop.set()
        await worker
    by_id = {r.job_id: r for r in results}
    assert len(by_id) == 2 * len(CASES)  # none twice: nothing was redelivered
    for v in range(len(CASES)):
        assert by_id[f"good-{v}"].status == "done"
        assert by_id[f"good-{v}"].labels[0].index == v
    nameless = [r for r in results if r.job_id not in {c.name for c in CASES} and not r.job_id.startswith("good-")]
    named = {c.name: by_id[c.name] for c in CASES if c.name not in NAMELESS}
    named |= {"headers-3000-deep": next(r for r in nameless if r.status == "failed")}
    named |= {"no-properties-at-all": next(r for r in nameless if r.status == "done")}
    dead = {d.message_id: d.headers or {} for d in await drain(names.dead)}
    for case in CASES:
        result = named[case.name]
        assert (case.name, result.status) == (case.name, case.status)
        if case.error is None:
            assert result.labels[0].index == 7
            assert 0 <= result.timings.get("queued", 0) < 60, case.name  # no header can skew it
        else:
            assert result.error is not None
            assert (case.name, result.error.error) == (case.name, case.error)
            assert dead[result.job_id][ERROR_HEADER] == case.error
    assert "x-retries" in named["retries-word"].error.detail  # type: ignore[union-attr]
    for name, header in OUT_OF_RANGE.items():  # named in the reason
        assert f"bad message header: {header}=" in named[name].error.detail, name  # type: ignore[union-attr]
    assert dead["huge-header-and-bad-body"][DROPPED_HEADER] == "x-junk"
    assert dead["double-header-and-bad-body"][DROPPED_HEADER] == "x-big"  # pamqp cannot encode it again
    assert dead["non-utf8-header-and-bad-body"][DROPPED_HEADER] == "x-text"
    assert "RecursionError" in str(dead[named["headers-3000-deep"].job_id][UNDECODABLE_HEADER])
    assert len(dead) == sum(1 for c in CASES if c.error)
    assert await queue_depth(names.work) == 0
