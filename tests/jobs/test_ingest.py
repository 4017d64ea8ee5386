"""``gateway ingest`` as a user runs it, in a process of its own, against the real RabbitMQ: a broker
that is not there, an interruption, and what an interrupted run leaves behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
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
from tests.jobs.conftest import BROKER_URL, class_pngs, gateway_process, queue_depth, wait_for_line

pytestmark = pytest.mark.rabbitmq


def _env(prefix: str, models_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        **extra,
    }


def _command(folder: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "service", "ingest", str(folder), "--out", str(out)]


def _ingest(folder: Path, out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(folder, out),
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


def test_no_broker_at_first_ends_with_a_clear_message_and_status(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """A broker address nothing listens on, ``--connect-timeout 2``: the run ends within seconds
    with exit status 69 (EX_UNAVAILABLE) and a last line saying what failed and what to do, no
    traceback. Before, it retried for ever."""
    class_pngs(tmp_path / "photos", 2)
    with socket.socket() as sock:  # a free port, closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(prefix, models_dir, GATEWAY_BROKER_URL=f"amqp://guest:guest@127.0.0.1:{port}/")
    started = time.monotonic()
    done = subprocess.run(
        [*_command(tmp_path / "photos", tmp_path / "out.jsonl"), "--connect-timeout", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 69, done.stderr
    assert time.monotonic() - started < 30
    assert done.stderr.splitlines()[-1] == (
        "gateway ingest: no connection to the message broker within 2 s (GATEWAY_BROKER_URL; the warnings above say "
        "why; --connect-timeout waits longer); nothing was published"
    )
    assert "Traceback" not in done.stderr


def test_ctrl_c_says_in_one_line_how_to_resume_and_the_same_command_does(
    tmp_path: Path, prefix: str, models_dir: Path
) -> None:
    """SIGINT (Ctrl-C) mid-run, with a slow worker: exit status 130 and one line naming how many
    images are done and that the same command resumes, no traceback. The same command then
    finishes the run: every image once in the output. Before, Ctrl-C printed two chained
    tracebacks (CancelledError, KeyboardInterrupt) and no hint."""
    count = 24
    class_pngs(tmp_path / "photos", count)
    out = tmp_path / "out.jsonl"
    env = _env(prefix, models_dir)
    log = tmp_path / "worker.log"
    slow = {"GATEWAY_BACKEND": "fake", "GATEWAY_FAKE_DELAY": "0.2", "GATEWAY_MAX_BATCH_SIZE": "2"}
    worker = gateway_process(["worker"], {**env, "GATEWAY_WORKER_METRICS_PORT": "0", **slow}, log)
    try:
        wait_for_line(log, "worker ready")
        run = _ingest(tmp_path / "photos", out, env)
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline
            assert run.poll() is None
            time.sleep(0.05)
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == 130, stderr
        assert "Traceback" not in stderr
        last = stderr.splitlines()[-1]
        assert re.fullmatch(
            rf"gateway ingest: interrupted with (\d+) of {count} images done in {re.escape(str(out))}; "
            "run the same command again to resume",
            last,
        ), last
        finished = int(last.split(" with ")[1].split(" of ")[0])
        assert 2 <= finished < count
        assert len(out.read_text().splitlines()) == finished
        again = subprocess.run(_command(tmp_path / "photos", out), env=env, capture_output=True, text=True, timeout=120)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert again.returncode == 0, again.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["path"] for line in lines) == sorted(str(p.resolve()) for p in (tmp_path / "photos").iterdir())
