"""``gateway ingest`` as a user runs it, in a process of its own, against the real RabbitMQ: what
an interrupted run leaves behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from service.jobs.ingest import run_id
from service.jobs.topology import Names, queue_exists
from tests.jobs.conftest import BROKER_URL, class_pngs, queue_depth

pytestmark = pytest.mark.rabbitmq


def _env(prefix: str, models_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        **extra,
    }


def _ingest(folder: Path, out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "service", "ingest", str(folder), "--out", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _exists(queue: str) -> bool:
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        return await queue_exists(connection, queue)


def _wait(condition: Callable[[], Coroutine[Any, Any, bool]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not asyncio.run(condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_an_interrupted_run_never_rerun_leaves_no_queue_behind(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """A run killed once its 6 jobs are queued (no worker yet), and never rerun: its results queue
    ``<prefix>.ingest.<run>`` is there while the run could resume, and the broker deletes it once
    unused for ``GATEWAY_INGEST_RESULTS_TTL`` (3 s here). Before, it stayed for ever (193 and 284
    messages were seen in such queues)."""
    class_pngs(tmp_path / "photos", 6)
    names = Names(prefix)
    out = tmp_path / "out.jsonl"
    queue = names.ingest_queue(run_id(out))
    run = _ingest(tmp_path / "photos", out, _env(prefix, models_dir, GATEWAY_INGEST_RESULTS_TTL="3"))
    try:
        _wait(lambda: _queued(names.work, 6), timeout=60)
    finally:
        run.kill()
        run.wait(timeout=30)
    assert asyncio.run(_exists(queue))
    _wait(lambda: _gone(queue), timeout=30)


async def _queued(queue: str, count: int) -> bool:
    try:
        return await queue_depth(queue) >= count
    except aio_pika.exceptions.ChannelClosed:  # not declared yet
        return False


async def _gone(queue: str) -> bool:
    return not await _exists(queue)
