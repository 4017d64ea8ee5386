"""The worker under faults, against the real RabbitMQ: refused publishes, overload, crash loops,
the classic queue of earlier versions, failed declarations, and a stuck event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import aio_pika
import numpy as np
import pytest
from aio_pika.abc import AbstractMessage

from service.backends.base import Images
from service.backends.fake import FakeBackend
from service.errors import DeadlineExceeded, QueueFull
from service.jobs.broker import Broker
from service.jobs.messages import ERROR_HEADER, REQUEUES_HEADER, RETRIES_HEADER, JobResult, request_message
from service.jobs.outcomes import ChannelLost, Outcomes
from service.jobs.policies import Policy, gateway_policies, rabbitmqctl_commands
from service.jobs.topology import REQUEST_KEY, Names
from service.jobs.upkeep import sample_depth
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from tests.jobs.conftest import (
    BROKER_URL,
    collect_results,
    drain,
    gateway_process,
    job,
    publish,
    queue_depth,
    wait_for_line,
)

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]


async def classic_results_queue(names: Names) -> None:
    """Declare the results queue classic, as earlier versions did (the topology keeps it as it is):
    the refusal tests need a queue that ``max-length: 0, overflow: reject-publish`` refuses at once; a
    quorum queue lets one message in first."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        await (await connection.channel()).declare_queue(names.results, durable=True)


async def results(names: Names, count: int, timeout: float = 60) -> dict[str, JobResult]:
    return {r.job_id: r for r in await collect_results(names, count, timeout)}


def settings_for(make: MakeSettings, prefix: str, **kw: object) -> Settings:
    return make(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, backend="fake", **kw)


class Publishes:
    """Every ``Broker.publish`` call made in this test, with its outcome (None: confirmed)."""

    def __init__(self) -> None:
        self.tries: list[tuple[str, str | None, BaseException | None]] = []

    def results(self, job_id: str | None = None, *, refused: bool = False) -> int:
        """Result publishes tried (for ``job_id``; only those that failed with ``refused``)."""
        return sum(
            1
            for target, message_id, outcome in self.tries
            if target == "results" and job_id in (None, message_id) and (outcome is not None or not refused)
        )


@pytest.fixture
def publishes(monkeypatch: pytest.MonkeyPatch) -> Publishes:
    """Wraps ``Broker.publish`` to record each call; what it does is unchanged."""
    record = Publishes()
    real = Broker.publish

    async def publish(self: Broker, target: Any, message: AbstractMessage, routing_key: str) -> None:
        try:
            await real(self, target, message, routing_key)
        except BaseException as exc:
            record.tries.append((target, message.message_id, exc))
            raise
        record.tries.append((target, message.message_id, None))

    monkeypatch.setattr(Broker, "publish", publish)
    return record


async def publish_only(names: Names, *messages: aio_pika.Message) -> None:
    """Publish to the requests exchange, confirmed, without declaring anything (``publish``
    declares the topology, which binds the results queue again)."""
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(names.requests, ensure=False)
        for message in messages:
            await exchange.publish(message, REQUEST_KEY)


async def consumed_by_a_worker(names: Names) -> None:
    """Wait until a worker consumes the work queue (it has declared its topology)."""
    async with asyncio.timeout(30):
        while True:
            try:
                connection = await aio_pika.connect(BROKER_URL)
                async with connection:
                    queue = await (await connection.channel()).declare_queue(names.work, passive=True)
                    if queue.declaration_result.consumer_count:
                        return
            except aio_pika.exceptions.ChannelNotFoundEntity:
                pass
            await asyncio.sleep(0.05)


async def test_an_unroutable_result_is_not_taken_as_published(
    gateway_factory: MakeSettings, prefix: str, publishes: Publishes
) -> None:
    """The results queue is unbound from its exchange after the worker declared its topology, so
    every result publish is returned as unroutable (``mandatory``). A returned publish is a refusal
    (aio-pika's ``on_return_raises``): the worker keeps the input and publishes again once the
    binding is back, and every job gets its result. Before, a returned publish counted as
    confirmed: the input was acked and its result lost. (The earlier version of this test unbound
    before the worker started, which declared the binding again: it could not fail.)"""
    names = Names(prefix)
    settings = settings_for(gateway_factory, prefix, worker_prefetch=2, max_batch_size=1)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    try:
        await consumed_by_a_worker(names)
        connection = await aio_pika.connect(BROKER_URL)
        async with connection:
            results_queue = await (await connection.channel()).declare_queue(names.results, passive=True)
            await results_queue.unbind(names.results, "#")
            await publish_only(names, *(job(v, f"j{v}") for v in range(5)))
            async with asyncio.timeout(30):  # as many result publishes as jobs, all returned meanwhile
                while publishes.results() < 5:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await results_queue.bind(names.results, "#")
        done = await results(names, 5, timeout=30)
    finally:
        stop.set()
        await worker
    assert sorted(done) == [f"j{v}" for v in range(5)]
    assert {r.status for r in done.values()} == {"done"}
    refusals = [exc for target, _, exc in publishes.tries if target == "results" and exc is not None]
    assert refusals
    assert all("could not route" in str(exc) for exc in refusals)
    assert await queue_depth(names.work) == 0
    assert await queue_depth(names.dead) == 0


async def test_broker_refusals_use_up_no_delivery(
    gateway_factory: MakeSettings, prefix: str, publishes: Publishes
) -> None:
    """With the production policies applied (delivery limit 2), a policy of higher priority makes
    the results queue refuse every publish (``max-length`` 0, ``overflow: reject-publish``: the
    broker nacks). Each job's result publish is refused more than the delivery limit allows; then
    the refusal is lifted and every job is done, none dead-lettered: the worker kept each input
    and retried its result, using up no delivery. Before, each refusal rejected the input with
    requeue, the quorum queue counted a delivery each time, and the good jobs were dead-lettered
    (``delivery_limit``) with no result."""
    names = Names(prefix)
    limit = 2
    refuse = Policy(
        f"{prefix}-refuse",
        f"^{re.escape(prefix)}\\.results$",
        "queues",
        {"max-length": 0, "overflow": "reject-publish"},
        20,
    )
    settings = settings_for(gateway_factory, prefix, worker_prefetch=4, max_batch_size=4, queue_delivery_limit=limit)
    jobs = [f"j{v}" for v in range(4)]
    await classic_results_queue(names)
    _set_policies(names, limit)
    try:
        await asyncio.to_thread(subprocess.run, rabbitmqctl_commands([refuse])[0], check=True, capture_output=True)
        await publish(names, *(job(v, j) for v, j in enumerate(jobs)))
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
        try:
            async with asyncio.timeout(60):  # each job refused beyond the limit, or dead-lettered
                while min(publishes.results(j, refused=True) for j in jobs) <= limit + 1:
                    if await queue_depth(names.dead):
                        break
                    await asyncio.sleep(0.05)
            assert await queue_depth(names.dead) == 0
            await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "clear_policy", refuse.name], check=True)
            done = await results(names, len(jobs), timeout=30)
        finally:
            stop.set()
            await worker
    finally:
        await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "clear_policy", refuse.name], capture_output=True)
        _clear_policies(names)
    assert {k: r.status for k, r in done.items()} == dict.fromkeys(jobs, "done")
    assert await queue_depth(names.dead) == 0
    assert await queue_depth(names.work) == 0


class Overloaded(FakeBackend):
    """Refuses the first batches as a full Triton queue, then one with a passed deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals: list[Exception] = [QueueFull("Triton's queue is full"), DeadlineExceeded("too slow")]

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        if self.refusals:
            self.batches.append(len(images))
            raise self.refusals.pop(0)
        return await super().infer(images, timeout=timeout)


async def test_overload_is_requeued_after_a_backoff_without_using_a_retry(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """A full queue and a passed deadline are not the job's fault: with no retries allowed at all,
    the job is requeued (x-requeues counts), then done; nothing is dead-lettered. Before, both took
    the retry path and good jobs were dead-lettered after three immediate retries."""
    names = Names(prefix)
    settings = settings_for(gateway_factory, prefix, max_retries=0)
    await publish(names, job(9, "busy"))
    stop = asyncio.Event()
    started = time.monotonic()
    worker = asyncio.create_task(run_worker(settings, stop, backend=Overloaded()))
    (result,) = (await results(names, 1)).values()
    elapsed = time.monotonic() - started
    stop.set()
    await worker
    assert result.status == "done"
    assert result.labels[0].index == 9
    assert await queue_depth(names.dead) == 0
    assert elapsed >= 0.25 + 0.5  # two backoffs: 0.5 s and 1 s, each at least half of that


async def test_prefetch_beyond_the_batcher_queue_is_refused(gateway_factory: MakeSettings) -> None:
    with pytest.raises(ValueError, match=r"GATEWAY_MAX_QUEUE_SIZE \(256\) must be at least --worker-prefetch"):
        gateway_factory(worker_prefetch=300, max_queue_size=256)
    assert gateway_factory(max_batch_size=64, max_inflight_batches=4, max_queue_size=256).prefetch == 256


def _set_policies(names: Names, limit: int) -> None:
    for command in rabbitmqctl_commands(gateway_policies(names, limit)):
        subprocess.run(command, check=True, capture_output=True)


def _clear_policies(names: Names) -> None:
    for policy in gateway_policies(names, 1):
        subprocess.run(["rabbitmqctl", "clear_policy", policy.name], capture_output=True)


async def test_the_delivery_limit_policy_dead_letters_a_crash_loop(prefix: str) -> None:
    """The quorum queue with `gateway queues policies` applied: a message whose consumer dies
    holding it three times is dead-lettered by RabbitMQ itself, with reason delivery_limit."""
    names = Names(prefix)
    _set_policies(names, 2)
    try:
        await publish(names, job(1, "poison"))
        for _ in range(3):
            consumer = await aio_pika.connect(BROKER_URL)
            channel = await consumer.channel()
            queue = await channel.declare_queue(names.work, passive=True)
            assert await queue.get(fail=False) is not None
            await consumer.close()  # dies without an ack
        async with asyncio.timeout(10):
            while await queue_depth(names.dead) == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        (dead,) = await drain(names.dead)
        assert dead.message_id == "poison"
        assert dead.headers["x-first-death-reason"] == "delivery_limit"
        assert await queue_depth(names.work) == 0
    finally:
        _clear_policies(names)


def test_a_job_that_kills_its_workers_fails_with_delivery_limit(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """A job hangs every worker that takes it (fake backend, 60 s per batch); each is SIGKILLed,
    as the kubelet would after the liveness probe fails. The third delivery is refused by the
    worker itself: a `failed` result (delivery_limit) and a dead-letter copy; the loop ends."""
    names = Names(prefix)
    asyncio.run(publish(names, job(1, "hangs")))
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_FAKE_DELAY": "60",
        "GATEWAY_REQUEST_TIMEOUT": "120",
        "GATEWAY_QUEUE_DELIVERY_LIMIT": "2",
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_WORKER_HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
    }
    for round_ in range(2):
        log = tmp_path / f"worker-{round_}.log"
        worker = gateway_process(["worker"], env, log)
        wait_for_line(log, "worker ready")
        deadline = time.monotonic() + 30
        while asyncio.run(queue_depth(names.work)) != 0:  # the job is taken (unacked)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    log = tmp_path / "worker-last.log"
    worker = gateway_process(["worker"], env, log)
    try:
        (result,) = asyncio.run(results(names, 1)).values()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    assert result.status == "failed"
    assert result.error is not None
    assert result.error.error == "delivery_limit"
    assert "delivered 3 times" in result.error.detail
    (dead,) = asyncio.run(drain(names.dead))
    assert dead.headers[ERROR_HEADER] == "delivery_limit"


async def test_jobs_in_the_classic_queue_of_earlier_versions_are_migrated(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """Jobs queued by an earlier version (classic <prefix>.requests queue with arguments, results
    queue with its old arguments) are moved to the quorum queue by the worker and all classified;
    the classic queue is unbound at once and deleted once empty."""
    names = Names(prefix)
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(names.requests, aio_pika.ExchangeType.DIRECT, durable=True)
        legacy = await channel.declare_queue(
            names.legacy_requests, durable=True, arguments={"x-dead-letter-exchange": names.dead}
        )
        await legacy.bind(exchange, REQUEST_KEY)
        await channel.declare_queue(
            names.results, durable=True, arguments={"x-max-length": 1_000_000, "x-overflow": "drop-head"}
        )
        for v in range(3):
            await exchange.publish(job(v, f"old-{v}"), REQUEST_KEY)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings_for(gateway_factory, prefix), stop, backend=FakeBackend()))
    done = await results(names, 3)
    stop.set()
    await worker
    assert {k: r.status for k, r in done.items()} == {f"old-{v}": "done" for v in range(3)}
    with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
        await queue_depth(names.legacy_requests)


def _connections() -> int:
    listed = subprocess.run(["rabbitmqctl", "list_connections", "-q", "name"], capture_output=True, text=True)
    return len([line for line in listed.stdout.splitlines() if line.strip()])


async def test_a_failed_declaration_does_not_leak_connections(prefix: str) -> None:
    """The work queue exists with another type (a classic queue), so every declaration fails with
    PRECONDITION_FAILED and the broker keeps retrying; the number of open connections stays put.
    Before, each retry left its connection open."""
    names = Names(prefix)
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(names.work, durable=True)  # classic: the quorum declare will fail
        before = _connections()
        broker = Broker(BROKER_URL, names)
        broker.start()
        await asyncio.sleep(4)  # several retries (0.5, 1, 2 s)
        during = _connections()
        await broker.aclose()
    assert not broker.connected.is_set()
    assert during <= before + 1


async def test_the_queue_depth_gauge_follows_the_broker(prefix: str) -> None:
    """The gauge reads the broker's count each time (aio-pika's robust channel hands back the
    first passive declaration's cached count)."""
    names = Names(prefix)
    broker = Broker(BROKER_URL, names)
    await broker.connect(timeout=10)
    metrics = Metrics()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_depth(broker, metrics, stop, interval=0.1))
    try:
        for expected in (2, 5):
            await publish(names, *(job(v, f"d{v}") for v in range(expected - await queue_depth(names.work))))
            async with asyncio.timeout(5):
                while metrics.queue_depth_messages.labels(names.work)._value.get() != expected:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        stop.set()
        await sampler  # ends by itself, after its broker call
        await broker.aclose()


async def test_liveness_fails_while_the_event_loop_is_stuck(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """`gateway alive` passes while the worker's loop runs, and fails while the loop is blocked
    (the metrics endpoint, served from a thread, would still answer)."""
    heartbeat = tmp_path / "hb"
    settings = settings_for(gateway_factory, prefix, worker_heartbeat_file=heartbeat)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
    alive = [sys.executable, "-m", "service", "alive", "--file", str(heartbeat), "--max-age", "2.5"]
    try:
        async with asyncio.timeout(30):
            while not heartbeat.exists():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # a few heartbeats later
        assert (await asyncio.to_thread(subprocess.run, alive, capture_output=True)).returncode == 0
        outcome: list[subprocess.CompletedProcess[bytes]] = []

        def probe_later() -> None:
            time.sleep(4.0)
            outcome.append(subprocess.run(alive, capture_output=True))

        prober = threading.Thread(target=probe_later)
        prober.start()
        time.sleep(6)  # noqa: ASYNC251 - the point: the event loop is stuck
        prober.join()
        assert outcome[0].returncode == 1
        assert b"not alive" in outcome[0].stderr
    finally:
        stop.set()
        await worker


def test_requeued_and_retried_headers_are_distinct() -> None:
    message = request_message(
        b"x", job_id="j", content_type="image/png", filename=None, top_k=1, reply_to="r", requeues=2
    )
    assert message.headers[REQUEUES_HEADER] == 2
    assert message.headers[RETRIES_HEADER] == 0


def test_policies_are_applied_through_the_management_api(prefix: str) -> None:
    """`gateway queues policies --apply URL` puts both policies, with the settings' values, and
    applying them again (every worker start in Kubernetes) changes nothing."""
    command = [
        sys.executable,
        "-m",
        "service",
        "queues",
        "policies",
        "--queue-prefix",
        prefix,
        "--queue-delivery-limit",
        "7",
        "--apply",
        "http://guest:guest@127.0.0.1:15672",
    ]
    try:
        for _ in range(2):
            deadline = time.monotonic() + 20  # the plugin may still be starting
            while (run := subprocess.run(command, capture_output=True, text=True)).returncode != 0:
                assert time.monotonic() < deadline, run.stderr
                time.sleep(0.5)
            assert f"{prefix}-work" in run.stdout
        listed = subprocess.run(["rabbitmqctl", "list_policies", "-q"], capture_output=True, text=True).stdout
        work = next(line for line in listed.splitlines() if f"{prefix}-work" in line)
        assert '"delivery-limit":7' in work.replace(" ", "")
        assert f'"dead-letter-exchange":"{prefix}.dead"' in work.replace(" ", "")
        assert f"{prefix}-results" in listed
    finally:
        _clear_policies(Names(prefix))


class NaNScores(FakeBackend):
    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        scores = await super().infer(images, timeout=timeout)
        red = np.array([image[0, 0, 0] for image in images])
        scores[red == 13] = np.nan
        return scores


async def test_non_finite_scores_fail_the_job_instead_of_hanging_it(gateway_factory: MakeSettings, prefix: str) -> None:
    """A NaN row fails its job (backend_error, retried then dead-lettered) and the others finish.
    Before, the result could not be published and the job never finished."""
    names = Names(prefix)
    await publish(names, job(13, "nan"), job(3, "fine"))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings_for(gateway_factory, prefix, max_retries=1), stop, NaNScores()))
    done = await results(names, 2)
    stop.set()
    await worker
    assert done["fine"].status == "done"
    assert done["nan"].status == "failed"
    assert done["nan"].error is not None
    assert "non-finite" in done["nan"].error.detail


class CuttableLink:
    """A TCP relay to RabbitMQ on a free local port whose connections the test can cut (a flaky
    network): only the connections made through it are affected."""

    def __init__(self) -> None:
        self.transports: list[asyncio.Transport] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"amqp://guest:guest@127.0.0.1:{port}/"

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", 5672)
        for writer in (client_writer, broker_writer):
            self.transports.append(writer.transport)  # type: ignore[arg-type]

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with suppress(OSError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.transport.abort()

        await asyncio.gather(pipe(client_reader, broker_writer), pipe(broker_reader, client_writer))

    def cut(self) -> None:
        """Drop every connection made so far, both ways at once (no closing handshake)."""
        for transport in self.transports:
            transport.abort()
        self.transports.clear()

    async def aclose(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_an_outcome_retried_when_its_channel_is_lost_is_not_published(
    gateway_factory: MakeSettings, prefix: str, publishes: Publishes, caplog: pytest.LogCaptureFixture
) -> None:
    """The results queue refuses publishes, so two jobs' results are retried in place; then the
    worker's connection is cut (a relay drops it), aio-pika reconnects, and the broker redelivers
    both jobs on the new channel. The tries of the old deliveries end with their channel (aiormq
    cancels a closed channel's consumer tasks) and publish nothing on the new one: once the refusal
    is lifted each job has exactly one result, nothing is acked on the wrong channel (the queue is
    empty, the worker logged no error). A guard for the retry loop under a flaky network; it also
    passed before."""
    names = Names(prefix)
    refuse = Policy(
        f"{prefix}-refuse",
        f"^{re.escape(prefix)}\\.results$",
        "queues",
        {"max-length": 0, "overflow": "reject-publish"},
        20,
    )
    link = CuttableLink()
    url = await link.start()
    settings = gateway_factory(
        broker_url=url, queue_prefix=prefix, worker_metrics_port=0, backend="fake", worker_prefetch=2
    )
    jobs = ["a", "b"]
    await classic_results_queue(names)
    await publish(names, *(job(v, j) for v, j in enumerate(jobs)))
    try:
        await asyncio.to_thread(subprocess.run, rabbitmqctl_commands([refuse])[0], check=True, capture_output=True)
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop, backend=FakeBackend()))
        try:
            async with asyncio.timeout(30):  # both results refused: their deliveries are held, retrying
                while min(publishes.results(j, refused=True) for j in jobs) < 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            before = publishes.results(refused=True)
            link.cut()
            async with asyncio.timeout(30):  # reconnected: the redelivered jobs are refused again
                while publishes.results(refused=True) < before + 4:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "clear_policy", refuse.name], check=True)
            await results_arrive(names, len(jobs))
        finally:
            stop.set()
            await worker  # its drain lets every held delivery make its next try
    finally:
        await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "clear_policy", refuse.name], capture_output=True)
        await link.aclose()
    done = await drain(names.results)
    assert sorted(m.message_id for m in done) == jobs  # one result each
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("service")] == []
    assert await queue_depth(names.work) == 0


async def results_arrive(names: Names, count: int, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while await queue_depth(names.results) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_a_refused_publish_of_a_message_whose_channel_closed_ends_as_channel_lost(prefix: str) -> None:
    """A message taken from the real broker, its channel then closed, and a broker that refuses
    the publish (not connected): the try ends as a lost channel (the broker redelivers it), not as
    an error. aio-pika's ``message.channel`` raises ChannelInvalidStateError for a closed channel,
    which the worker read as ``.is_closed``: the error escaped as a crash of the job (logged with a
    traceback, counted as rejected)."""
    names = Names(prefix)
    await publish(names, job(1, "held"))
    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(names.work, passive=True)
        message = await queue.get(timeout=5)
        assert message is not None
        await channel.close()
    broker = Broker(BROKER_URL, names)  # never connected: every publish is refused at once
    with pytest.raises(ChannelLost):
        await Outcomes(broker, Metrics()).publish("results", aio_pika.Message(b"{}"), "jobs", message)
    assert await queue_depth(names.work) == 1  # back in the queue, for another worker
