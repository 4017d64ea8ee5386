"""Offline mode on a three-node RabbitMQ cluster on this machine (``loadtests.harness.rabbitmq_cluster``):
the production policies, clients that move to a live node when theirs is killed, nothing lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aio_pika
import httpx
import pytest

from loadtests.harness import dead_addresses
from loadtests.harness.rabbitmq_cluster import ClusterUnhealthy, Node, RabbitCluster
from service.jobs.broker import Broker
from service.jobs.policies import gateway_policies, rabbitmqctl_commands
from service.jobs.topology import REQUEST_KEY, Names
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import broker_ok, class_pngs, gateway_process, wait_for_line
from tests.jobs.test_broker_addresses import outage_across
from tests.jobs.webhook_receiver import LOOPBACK, SECRET, receiving

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


@pytest.fixture(autouse=True)
def whole_cluster(cluster: RabbitCluster) -> None:
    """Each test starts on the whole cluster: every node up, serving and clustered, no partition.
    A test that killed a node and could not bring it back (its failure is its own) does not leave
    the next one a broken cluster: the node is waited for or restarted here, with a warning saying
    what was wrong, and the test errors with the nodes' own account if it cannot be repaired."""
    try:
        repaired = cluster.ensure_healthy()
    except ClusterUnhealthy as exc:
        pytest.fail(f"the cluster is not whole before this test and could not be repaired: {exc}", pytrace=False)
    if repaired:
        warnings.warn(f"the cluster was not whole before this test: {'; '.join(repaired)}", stacklevel=1)


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


@pytest.mark.parametrize("where", ["first", "middle", "last"])
async def test_with_a_dead_address_anywhere_a_client_is_back_within_2_s_of_a_node_kill(
    cluster: RabbitCluster, prefix: str, where: str
) -> None:
    """The cluster's three addresses and a blackholed one (its SYNs dropped: a host gone from the
    network) first, in the middle or last of the list: the node the client is connected to is
    SIGKILLed while it publishes every 10 ms. It is connected to another node, its channels
    restored, within 2 s of the kill, and publishes are confirmed again within 3 s (the rest is the
    quorum queue electing a leader among the survivors: until then the new node nacks them). Before,
    a second loop moved the address too, and one kill in three took 15-60 s
    (``python -m loadtests.broker_failover``)."""
    live = [node.url for node in cluster.nodes]
    index = {"first": 0, "middle": len(live) // 2, "last": len(live)}[where]
    loop = asyncio.get_running_loop()
    killed_at: list[float] = []
    restored_at: list[float] = []
    with dead_addresses.blackholed() as dead:
        urls = ",".join([*live[:index], dead, *live[index:]])
        broker = Broker(urls, Names(f"{prefix}-dead-{where}"), publish_timeout=5)
        await broker.connect(timeout=30)
        assert broker.connection is not None
        broker.connection.reconnect_callbacks.add(lambda *_: restored_at.append(loop.time()))
        killed = node_of(cluster, int(broker.url.rsplit(":", 1)[1].strip("/")))

        async def kill() -> None:
            killed_at.append(loop.time())
            await asyncio.to_thread(cluster.kill, cluster.nodes[killed])

        try:
            await broker.publish("requests", aio_pika.Message(b"before"), REQUEST_KEY)
            publishing, refused = await outage_across(broker, kill)
            assert node_of(cluster, int(broker.url.rsplit(":", 1)[1].strip("/"))) != killed
        finally:
            await broker.aclose()
            await asyncio.to_thread(cluster.start_node, cluster.nodes[killed])
    back = restored_at[0] - killed_at[0]
    print(
        f"dead address {where}: on another node {back:.2f} s after the kill, publishing again after "
        f"{publishing:.2f} s, {refused} publishes refused"
    )
    assert back < 2.0
    assert publishing < 3.0


def leader_of(cluster: RabbitCluster, queue: str) -> int:
    """Index of the node that holds the quorum queue's leader."""
    node = next(n for n in cluster.nodes if cluster.running(n))
    rows = json.loads(cluster.ctl(node, "list_queues", "name", "leader", "--formatter", "json"))
    leader = next(row["leader"] for row in rows if row["name"] == queue)
    return next(i for i, n in enumerate(cluster.nodes) if n.name == leader)


def result_lines(out: Path) -> int:
    return len(out.read_text().splitlines()) if out.exists() else 0


def ingest_env(cluster: RabbitCluster, queue_prefix: str, models_dir: Path, fake_delay: str) -> dict[str, str]:
    """Workers and ingest on every node, with the fake backend taking ``fake_delay`` s per batch of 8."""
    return {
        **os.environ,
        "GATEWAY_BROKER_URL": cluster.urls,
        "GATEWAY_QUEUE_PREFIX": queue_prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_FAKE_DELAY": fake_delay,
        "GATEWAY_MAX_BATCH_SIZE": "8",
    }


@contextmanager
def two_workers(env: dict[str, str], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two ``gateway worker`` processes, ready; SIGTERMed and waited for at the end."""
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            log = logs / f"worker-{i}.log"
            workers.append(gateway_process(["worker"], env, log))
            wait_for_line(log, "worker ready")
        yield workers
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)


@contextmanager
def ingest_of(env: dict[str, str], folder: Path, out: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``gateway ingest`` of ``folder`` into ``out`` (its log in ``log``), resending after 20 s
    without a result; killed if the test leaves it running."""
    command = ["ingest", str(folder), "--out", str(out), "--resend-after", "20"]
    ingest = gateway_process(command, {**env, "GATEWAY_LOG_LEVEL": "info"}, log)
    try:
        yield ingest
    finally:
        if ingest.poll() is None:
            ingest.kill()


def wait_for_results(ingest: subprocess.Popen[bytes], out: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while result_lines(out) < count:
        assert ingest.poll() is None, f"ingest ended with {ingest.returncode}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def finish(ingest: subprocess.Popen[bytes], log: Path) -> str:
    """Wait for the ingest to end, check it succeeded; its log."""
    ingest.wait(timeout=300)
    text = log.read_text()
    assert ingest.returncode == 0, text[-3000:]
    return text


def connected_node(cluster: RabbitCluster, log: Path) -> int:
    """The node a process given ``cluster.urls`` connected to first, from its log (``broker:
    connected to address N of 3``: the info line names no host)."""
    wait_for_line(log, "broker: connected to address")
    line = next(line for line in log.read_text().splitlines() if "broker: connected to address" in line)
    return int(line.split("broker: connected to address ", 1)[1].split()[0]) - 1


def assert_each_done_once(out: Path, classes: dict[Path, int]) -> None:
    """One result per image from the client's point of view (ingest keeps the first per image), done,
    with its class."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(classes)
    assert {row["path"] for row in rows} == {str(p) for p in classes}
    assert all(row["status"] == "done" for row in rows)
    assert all(row["labels"][0]["index"] == classes[Path(row["path"])] for row in rows)


@pytest.mark.parametrize("victim", ["work queue's leader", "ingest's own node"])
def test_killing_a_node_mid_ingest_loses_no_image(
    cluster: RabbitCluster, prefix: str, tmp_path: Path, models_dir: Path, victim: str
) -> None:
    """1,000 images through two workers; when a third of the results are in, a node is SIGKILLed:
    the one holding the work queue's leader, or the one ``gateway ingest`` is connected to. Every
    image ends done, once, with its class, and without the ingest's resend (what it needs before
    resending is lost, or held for a dead consumer); the time from the kill to the next result is
    printed (the bound asserted is generous: a shared 2-core machine)."""
    count = 1000
    classes = class_pngs(tmp_path / "images", count)
    queue_prefix = f"{prefix}-{'leader' if victim.startswith('work') else 'own'}"
    env = ingest_env(cluster, queue_prefix, models_dir, fake_delay="0.1")
    out, log = tmp_path / "out.jsonl", tmp_path / "ingest.log"
    killed = None
    try:
        with two_workers(env, tmp_path) as workers:
            if victim.startswith("work"):
                target = leader_of(cluster, f"{queue_prefix}.work")  # asked before: rabbitmqctl takes a second or two
            started = time.monotonic()
            with ingest_of(env, tmp_path / "images", out, log) as ingest:
                if not victim.startswith("work"):
                    target = connected_node(cluster, log)
                wait_for_results(ingest, out, count // 3, timeout=180)
                at_kill = result_lines(out)
                killed = target
                cluster.kill(cluster.nodes[killed])  # returns once the node's VM is gone
                seen = result_lines(out)
                last = time.monotonic()
                stall = 0.0  # the longest time without a new result, from the kill until the ingest ends
                while ingest.poll() is None:
                    now, lines = time.monotonic(), result_lines(out)
                    if lines > seen:
                        stall, seen, last = max(stall, now - last), lines, now
                    assert now - last < 60, f"no result for 60 s after the {victim} was killed"
                    time.sleep(0.01)
                text = finish(ingest, log)
                total = time.monotonic() - started
    finally:
        if killed is not None:
            cluster.start_node(cluster.nodes[killed])
    assert at_kill < count * 2 // 3  # the kill came mid-run
    assert_each_done_once(out, classes)
    assert "images again" not in text  # every result came without the resend
    logs = [text, *((tmp_path / f"worker-{i}.log").read_text() for i in range(len(workers)))]
    moved = sum(t.count("broker: lost") for t in logs)
    print(
        f"{count} images in {total:.1f} s; longest wait for a result after the {victim} was killed "
        f"{stall:.2f} s; clients moved to another node {moved} times"
    )


def test_a_rolling_restart_mid_ingest_loses_no_image(
    cluster: RabbitCluster, prefix: str, tmp_path: Path, models_dir: Path
) -> None:
    """Maintenance: each node stopped cleanly and started again, one at a time, while 2,400 images
    go through two workers. Every image ends done once; the rate before and during the restart is
    printed (the dip: clients move, quorum queues elect leaders, a returning node catches up)."""
    count = 2400
    classes = class_pngs(tmp_path / "images", count)
    env = ingest_env(cluster, f"{prefix}-rolling", models_dir, fake_delay="0.5")
    out = tmp_path / "out.jsonl"
    try:
        with two_workers(env, tmp_path), ingest_of(env, tmp_path / "images", out, tmp_path / "ingest.log") as ingest:
            wait_for_results(ingest, out, 100, timeout=120)
            mark, done_at_mark = time.monotonic(), result_lines(out)
            time.sleep(3)
            before_rate = (result_lines(out) - done_at_mark) / (time.monotonic() - mark)
            restart_started, done_at_restart = time.monotonic(), result_lines(out)
            for node in cluster.nodes:
                cluster.stop_node(node)
                cluster.start_node(node)
            restart_seconds = time.monotonic() - restart_started
            during_rate = (result_lines(out) - done_at_restart) / restart_seconds
            assert result_lines(out) < count, "the ingest ended before the restart did: give it more images"
            finish(ingest, tmp_path / "ingest.log")
    finally:
        for node in cluster.nodes:
            if not cluster.running(node):
                cluster.start_node(node)
    assert_each_done_once(out, classes)
    print(
        f"rolling restart of 3 nodes took {restart_seconds:.0f} s: {during_rate:.0f} img/s during it "
        f"against {before_rate:.0f} before ({during_rate / before_rate:.2f}x)"
    )


def serving_again(cluster: RabbitCluster, node: Node, peer: Node, queue: str, within: float) -> float | None:
    """Seconds until ``node`` serves again (it confirms a publish, and ``peer`` counts it among
    the running nodes), or None if it does not ``within`` that many."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        serving = asyncio.run(publish_confirmed(node.url, queue, b"healed", timeout=5)) == "confirmed"
        if serving and len(cluster.members(peer)) == len(cluster.nodes):
            return time.monotonic() - started
        time.sleep(0.5)
    return None


async def declare_quorum(url: str, name: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})


async def publish_confirmed(url: str, queue: str, body: bytes, timeout: float) -> str:
    """Try to publish ``body`` to ``queue`` through the node at ``url``: "confirmed", or why not."""
    try:
        async with asyncio.timeout(timeout):
            connection = await aio_pika.connect(url, timeout=timeout)
            async with connection:
                channel = await connection.channel(publisher_confirms=True)
                await channel.default_exchange.publish(aio_pika.Message(body, delivery_mode=2), queue, mandatory=True)
                return "confirmed"
    except TimeoutError:
        return "not confirmed in time"
    except (aio_pika.exceptions.AMQPError, ConnectionError, OSError) as exc:
        return f"refused: {type(exc).__name__}"


def test_a_partitioned_node_takes_no_work_and_loses_none_when_it_heals(
    cluster: RabbitCluster, prefix: str, tmp_path: Path, models_dir: Path
) -> None:
    """The node the ingest is connected to is cut off from the other two (every packet between
    them dropped) a quarter into 2,400 images, for 30 s, then the link heals. The cut node confirms
    no publish while it is alone (pause_minority: it then closes its connections and refuses new
    ones); its clients move to the majority, which goes on; when the link heals the node rejoins,
    and every image ends done once."""
    count = 2400
    classes = class_pngs(tmp_path / "images", count)
    env = ingest_env(cluster, f"{prefix}-partition", models_dir, fake_delay="0.5")
    out = tmp_path / "out.jsonl"
    probe_queue = f"{prefix}-partition.probe"
    asyncio.run(declare_quorum(cluster.nodes[0].url, probe_queue))
    log = tmp_path / "ingest.log"
    try:
        with two_workers(env, tmp_path), ingest_of(env, tmp_path / "images", out, log) as ingest:
            cut = cluster.nodes[connected_node(cluster, log)]
            majority = [node for node in cluster.nodes if node is not cut]
            wait_for_results(ingest, out, count // 4, timeout=180)
            cluster.partition(cut)
            cut_at = time.monotonic()
            outcomes: list[tuple[float, str]] = []
            seen, last, stall = result_lines(out), cut_at, 0.0
            while time.monotonic() - cut_at < 30:
                outcome = asyncio.run(publish_confirmed(cut.url, probe_queue, b"minority", timeout=2))
                outcomes.append((time.monotonic() - cut_at, outcome))
                now, lines = time.monotonic(), result_lines(out)
                if lines > seen:
                    stall, seen, last = max(stall, now - last), lines, now
                time.sleep(0.5)
            assert ingest.poll() is None, "the ingest ended during the partition: give it more images"
            cluster.heal()
            healed_at = time.monotonic()
            back = serving_again(cluster, cut, majority[0], probe_queue, within=20)  # it resumes in 2-4 s
            restarted = back is None
            if restarted:
                # Seen in 2 of 8 CI runs (RabbitMQ 3.10.8), and often since: the paused node had
                # not resumed 20-60 s after the heal. What an operator does then, and what the
                # test reports.
                warning = f"the cut node did not resume by itself; restarting it\n{cluster.diagnose(cut)}"
                warnings.warn(warning, stacklevel=1)
                # its stop_app once hung for 2 minutes: restart the node itself (its data is kept)
                cluster.kill(cut)
                cluster.start_node(cut)
                back = serving_again(cluster, cut, majority[0], probe_queue, within=120)
            rejoined = None if back is None else time.monotonic() - healed_at
            diagnosis = "" if rejoined is not None else cluster.diagnose(cut)
            text = finish(ingest, log)
    finally:
        cluster.heal()
    assert not [o for o in outcomes if o[1] == "confirmed"], outcomes  # nothing it could not replicate
    refused = [t for t, o in outcomes if o.startswith("refused")]
    assert refused, f"the cut node never paused: {outcomes}"
    assert rejoined is not None, f"the cut node did not serve again after the heal:\n{diagnosis}"
    assert_each_done_once(out, classes)
    print(
        f"cut node refused clients {refused[0]:.1f} s after the cut; longest wait for a result during "
        f"the partition {stall:.1f} s; serving again {rejoined:.0f} s after the heal"
        f"{' (after restarting it)' if restarted else ''}; the ingest "
        f"moved {text.count('broker: lost')} times"
    )


async def submit_until_accepted(client: httpx.AsyncClient, key: str, values: tuple[int, ...], hook: str) -> list[str]:
    """An idempotent submit of two images, retried with its key while the API answers 503 (as a
    client does while the API's broker connection moves); the job ids accepted."""
    files = [("file", (f"{key}-{v}.png", png_bytes(solid_image(v, 16)), "image/png")) for v in values]
    headers = {"Idempotency-Key": key, "Webhook-URL": hook}
    async with asyncio.timeout(90):
        while True:
            response = await client.post("/classify?mode=offline", files=files, headers=headers)
            if response.status_code != 503:
                break
            await asyncio.sleep(0.2)
    assert response.status_code == 202, response.text
    return [job["job_id"] for job in response.json()["jobs"]]


async def test_idempotent_submits_and_webhooks_keep_their_guarantees_across_a_node_loss(
    cluster: RabbitCluster, prefix: str, tmp_path: Path, models_dir: Path, gateway_factory: Callable[..., Settings]
) -> None:
    """Two API replicas and two workers on the cluster. 30 idempotent submits (2 images each, with a
    webhook); after the first 10, the node the first replica is connected to is SIGKILLed, and the
    submits go on through it (a 503 is retried with the same key). Then every key is submitted
    again on both replicas: each replays the job ids of its first acceptance, and no job is queued
    twice. Every job's webhook arrives signed (at least once: a duplicate carries the same
    webhook-id), every job reads ``done`` on both replicas, and nothing is dead-lettered."""
    queue_prefix = f"{prefix}-api"
    settings = gateway_factory(
        broker_url=cluster.urls, queue_prefix=queue_prefix, backend="fake", webhook_retry_delays="0.2,0.4", **LOOPBACK
    )
    env = {
        **ingest_env(cluster, queue_prefix, models_dir, fake_delay="0.05"),
        "GATEWAY_WEBHOOK_SECRET": SECRET,
        "GATEWAY_WEBHOOK_ALLOW_HTTP": "true",
        "GATEWAY_WEBHOOK_ALLOWLIST": "127.0.0.1/32",
        "GATEWAY_WEBHOOK_RETRY_DELAYS": "0.2,0.4",
    }
    killed = None
    keys = {f"order-{i}": (i % 250, (i + 100) % 250) for i in range(30)}
    accepted: dict[str, list[str]] = {}
    try:
        with two_workers(env, tmp_path):
            async with (
                receiving(lambda _id, _attempt: 204) as receiver,
                running_gateway(settings) as first,
                running_gateway(settings) as second,
            ):
                await broker_ok(first)
                await broker_ok(second)
                for i, (key, values) in enumerate(keys.items()):
                    if i == 10:
                        broker = first.app.state.gateway.jobs.broker
                        killed = node_of(cluster, int(broker.url.rsplit(":", 1)[1].strip("/")))
                        await asyncio.to_thread(cluster.kill, cluster.nodes[killed])
                        killed_at = time.monotonic()
                    accepted[key] = await submit_until_accepted(first, key, values, receiver.url)
                    if i == 10:
                        first_after = time.monotonic() - killed_at
                replays = {
                    key: [await submit_until_accepted(api, key, values, receiver.url) for api in (first, second)]
                    for key, values in keys.items()
                }
                jobs = [job for ids in accepted.values() for job in ids]
                await receiver.until(lambda: set(receiver.accepted) >= set(jobs), timeout=90)
                await asyncio.sleep(1.0)  # time for any stray duplicate
                async with asyncio.timeout(60):
                    for job in jobs:
                        for api in (first, second):
                            while (await api.get(f"/jobs/{job}")).json().get("status") != "done":  # noqa: ASYNC110
                                await asyncio.sleep(0.1)
            live = next(node for i, node in enumerate(cluster.nodes) if i != killed)
            rows = json.loads(cluster.ctl(live, "list_queues", "name", "messages", "--formatter", "json"))
    finally:
        if killed is not None:
            cluster.start_node(cluster.nodes[killed])
    assert all(replays[key] == [ids, ids] for key, ids in accepted.items())
    assert len(set(jobs)) == 2 * len(keys)
    assert set(receiver.accepted) == set(jobs)
    assert receiver.bad_signatures == 0
    depth = {row["name"]: row["messages"] for row in rows}
    assert depth[f"{queue_prefix}.dead"] == 0
    assert depth[f"{queue_prefix}.work"] == 0  # the replays queued nothing
    duplicates = sum(receiver.accepted.values()) - len(jobs)
    print(
        f"first submit after the SIGKILL accepted {first_after:.1f} s after it; {len(jobs)} jobs, "
        f"{duplicates} webhook duplicates"
    )
