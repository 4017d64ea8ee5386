"""A real RabbitMQ (127.0.0.1:5672 here and in CI; .ci/run starts it if it is down). Every test
uses its own name prefix and deletes what it declared."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import cv2
import httpx
import numpy as np
import pytest
from skimage import data as skdata

from service.jobs.messages import JobResult, request_message
from service.jobs.topology import REQUEST_KEY, Names, Route, declare
from tests.conftest import png_bytes, solid_image

BROKER_URL = os.environ.get("GATEWAY_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def _delete_everything(prefix: str) -> None:
    names = Names(prefix)
    listed = await asyncio.to_thread(
        subprocess.run, ["rabbitmqctl", "list_queues", "-q", "name"], capture_output=True, text=True
    )
    queues = [q.strip() for q in listed.stdout.splitlines() if q.strip().startswith(prefix + ".")]
    connection = await aio_pika.connect(BROKER_URL, timeout=10)
    async with connection:
        channel = await connection.channel()
        for queue in {*queues, names.work, names.legacy_requests, names.results, names.dead}:
            await channel.queue_delete(queue)
        for exchange in (names.requests, names.results, names.dead, names.notices):
            await channel.exchange_delete(exchange)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh queue/exchange prefix for one test, cleaned up after it."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    asyncio.run(_delete_everything(name))


@pytest.fixture(scope="session", autouse=True)
def broker_is_up() -> None:
    async def check() -> None:
        connection = await aio_pika.connect(BROKER_URL, timeout=10)
        await connection.close()

    try:
        asyncio.run(check())
    except Exception as exc:  # CI starts RabbitMQ; a missing broker is a failure, not a skip
        pytest.fail(f"RabbitMQ is not reachable at {BROKER_URL}: {exc} (start it: rabbitmq-server -detached)")


async def broker_ok(client: httpx.AsyncClient) -> None:
    """Wait until the gateway behind ``client`` has connected to the broker."""
    async with asyncio.timeout(30):
        while (await client.get("/readyz")).json()["checks"].get("broker") != "ok":  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def queue_depth(name: str) -> int:
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count or 0)


async def drain(name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message currently in a queue (acknowledged)."""
    connection = await aio_pika.connect(BROKER_URL)
    out = []
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        while (message := await queue.get(fail=False)) is not None:
            await message.ack()
            out.append(message)
    return out


def photo_variants(folder: Path, count: int, seed: int = 0) -> dict[Path, str]:
    """``count`` distinct JPEGs made from the cat and the espresso photos (random crops, sizes and
    JPEG qualities); returns each file's subject, "cat" or "espresso"."""
    rng = random.Random(seed)
    sources = {"cat": skdata.chelsea(), "espresso": skdata.coffee()}
    folder.mkdir(parents=True, exist_ok=True)
    subjects = {}
    for i in range(count):
        subject = "cat" if i % 2 == 0 else "espresso"
        rgb = sources[subject]
        h, w = rgb.shape[:2]
        scale = rng.uniform(0.97, 1.0)  # tighter crops of the espresso can read as consomme
        ch, cw = int(h * scale), int(w * scale)
        y, x = rng.randint(0, h - ch), rng.randint(0, w - cw)
        crop = rgb[y : y + ch, x : x + cw]
        size = rng.randint(256, 480)  # below 256 px the espresso is upscaled and sometimes reads as consomme
        crop = cv2.resize(crop, (size * cw // ch, size), interpolation=cv2.INTER_AREA)
        ok, buf = cv2.imencode(".jpg", crop[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, rng.randint(70, 95)])
        assert ok
        path = folder / f"{subject}-{i:04d}.jpg"
        path.write_bytes(buf.tobytes())
        subjects[path.resolve()] = subject
    return subjects


def class_pngs(folder: Path, count: int) -> dict[Path, int]:
    """Small PNGs the fake backend classifies by their red value: file i is class i % 250."""
    folder.mkdir(parents=True, exist_ok=True)
    classes = {}
    for i in range(count):
        image = solid_image(i % 250, 16)
        image[1, 1, 1] = i // 250  # keep the files distinct
        path = folder / f"img-{i:04d}.png"
        path.write_bytes(png_bytes(np.ascontiguousarray(image)))
        classes[path.resolve()] = i % 250
    return classes


def gateway_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "service", *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for_line(log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in {log}:\n{log.read_text() if log.exists() else ''}"
        time.sleep(0.1)


@pytest.fixture
async def aio_channel() -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        yield await connection.channel()


def worker_pids(prefix: str) -> list[int]:
    """PIDs of ``gateway worker`` processes started for this test (its queue prefix in their
    environment). The argument must be exactly ``worker``: test paths may contain the word."""
    marker = f"GATEWAY_QUEUE_PREFIX={prefix}".encode()
    pids = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"worker" in args and b"service" in args and marker in environ:
            pids.append(pid)
    return pids


def job(value: int, job_id: str, webhook: str | None = None) -> aio_pika.Message:
    """A job of one 8x8 PNG of red value ``value`` (the fake backend's class)."""
    return request_message(
        png_bytes(solid_image(value, 8)),
        job_id=job_id,
        content_type="image/png",
        filename=None,
        top_k=1,
        reply_to="jobs",
        webhook=webhook,
    )


async def publish(names: Names, *messages: aio_pika.Message, route: Route | None = None) -> None:
    """Declare the topology and publish each message to the requests exchange (confirmed), to the
    default model's queue or ``route``'s."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        topology = await declare(connection, channel, names, [route] if route is not None else [])
        for message in messages:
            await topology.requests_exchange.publish(message, route.key if route is not None else REQUEST_KEY)


async def collect_results(names: Names, count: int, timeout: float = 60) -> list[JobResult]:
    """Wait for ``count`` results in the results queue and take them."""
    async with asyncio.timeout(timeout):
        while await queue_depth(names.results) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return [JobResult.model_validate_json(m.body) for m in await drain(names.results)]
