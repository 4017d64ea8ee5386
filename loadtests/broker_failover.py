"""Broker fail-over with a dead address in ``GATEWAY_BROKER_URL``: how long the API is without a
node, and how many offline submits it answers 503 meanwhile.

A gateway (``gateway serve``, fake backend) is given a three-node cluster started on this machine
(``loadtests.harness.rabbitmq_cluster``) plus one dead address (``loadtests.harness.dead_addresses``:
refused, or blackholed) first, in the middle or last. A client submits offline jobs one after
another; the node the gateway is connected to is SIGKILLed; the row shows the seconds from the kill
to the next accepted (202) submit, and the submits answered 503 in between. The last rows are the
case of two addresses, one dead, where the live node closes the connection
(``rabbitmqctl close_all_connections``) and stays up. Each row is ``--rounds`` runs, each with a
fresh gateway process (so a fresh random start among the addresses): median and max.

    python -m loadtests.broker_failover --rounds 3
    python -m loadtests.broker_failover --rounds 3 --cwd /path/to/another/checkout   # a baseline
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import cv2
import httpx
import numpy as np

from loadtests.harness import dead_addresses
from loadtests.harness.http_load import stop_process
from loadtests.harness.rabbitmq_cluster import Node, RabbitCluster
from service.tune.runner import free_port

DEAD: dict[str, Callable[[], AbstractContextManager[str]]] = {
    "refused": dead_addresses.refused,
    "blackholed": dead_addresses.blackholed,
}
GIVE_UP = 90.0
"""Seconds after the loss without an accepted submit after which a run is reported as > this."""


def png() -> bytes:
    ok, data = cv2.imencode(".png", np.full((16, 16, 3), 7, np.uint8))
    assert ok
    return data.tobytes()


@contextmanager
def gateway(urls: list[str], work: Path, cwd: Path | None) -> Iterator[tuple[str, str]]:
    """A gateway process on a free port, connected to the broker; its URL and queue prefix."""
    port = free_port()
    log = work / f"gateway-{port}.log"
    prefix = f"failover-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": ",".join(urls),
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_MODELS_DIR": str(work / "models"),
        "GATEWAY_LOG_LEVEL": "info",
        "GATEWAY_GRPC_PORT": "0",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).json()["checks"].get("broker") == "ok":
                    break
            except (httpx.TransportError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not connect:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield url, prefix
    finally:
        stop_process(proc, timeout=20)


def connected_port(cluster: RabbitCluster, prefix: str) -> int:
    """The port of the node the gateway is connected to (RabbitMQ lists its connection, named
    after its queue prefix)."""
    listed = cluster.ctl(cluster.nodes[0], "list_connections", "-q", "port", "client_properties")
    ports = {int(line.split("\t", 1)[0]) for line in listed.splitlines() if prefix in line}
    assert len(ports) == 1, listed
    return ports.pop()


async def submits_across(url: str, lose: Callable[[], object]) -> tuple[float, int]:
    """Submit offline jobs one after another; once a few are accepted, ``lose()`` (in a thread,
    while the submits go on). Returns the outage the client saw: seconds from sending the first
    submit that failed to the next accepted one (0 if none failed), and the submits answered 503."""
    body = png()
    accepted, refused = 0, 0
    loss: asyncio.Task[object] | None = None
    first_failed: float | None = None
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            sent = time.monotonic()
            response = await client.post("/classify?mode=offline", files=[("file", ("x.png", body, "image/png"))])
            now = time.monotonic()
            if response.status_code == 202:
                accepted += 1
                if first_failed is not None:
                    return now - first_failed, refused
                if loss is not None and loss.done():
                    loss.result()
                    return 0.0, 0
                if accepted == 5:
                    loss = asyncio.create_task(asyncio.to_thread(lose))
            elif response.status_code == 503 and loss is not None:
                refused += 1
                first_failed = sent if first_failed is None else first_failed
            else:
                raise SystemExit(f"submit answered {response.status_code}: {response.text}")
            if first_failed is not None and now - first_failed > GIVE_UP:
                return float("inf"), refused
            await asyncio.sleep(0.01)


def run_kill(cluster: RabbitCluster, urls: list[str], work: Path, cwd: Path | None) -> tuple[float, int]:
    with gateway(urls, work, cwd) as (url, prefix):
        port = connected_port(cluster, prefix)
        node = next(n for n in cluster.nodes if n.amqp_port == port)
        try:
            return asyncio.run(submits_across(url, lambda: cluster.kill(node)))
        finally:
            cluster.start_node(node)


def run_drop(cluster: RabbitCluster, node: Node, urls: list[str], work: Path, cwd: Path | None) -> tuple[float, int]:
    with gateway(urls, work, cwd) as (url, _):
        return asyncio.run(
            submits_across(url, lambda: cluster.ctl(node, "close_all_connections", "broker_failover figure"))
        )


def row(name: str, runs: list[tuple[float, int]]) -> str:
    seconds = [s for s, _ in runs]
    refused = [r for _, r in runs]
    return (
        f"{name:<40} back after {statistics.median(seconds):6.2f} s median, {max(seconds):6.2f} max; "
        f"503s {statistics.median(refused):5.0f} median, {max(refused):4d} max  "
        f"(runs: {', '.join(f'{s:.2f} s/{r}' for s, r in runs)})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cwd", type=Path, default=None, help="run the gateway of another checkout")
    parser.add_argument("--dead", choices=sorted(DEAD), nargs="+", default=sorted(DEAD))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RabbitCluster(size=3) as cluster:
        work = Path(tmp)
        (work / "models").mkdir()
        live = [node.url for node in cluster.nodes]
        for kind in args.dead:
            with DEAD[kind]() as dead:
                for where, index in (("first", 0), ("middle", len(live) // 2), ("last", len(live))):
                    urls = [*live[:index], dead, *live[index:]]
                    runs = [run_kill(cluster, urls, work, args.cwd) for _ in range(args.rounds)]
                    print(row(f"{kind} {where}, live node killed", runs), flush=True)
                node = cluster.nodes[0]
                for where, urls in (("first", [dead, node.url]), ("last", [node.url, dead])):
                    runs = [run_drop(cluster, node, urls, work, args.cwd) for _ in range(args.rounds)]
                    print(row(f"{kind} {where} of 2, connection closed", runs), flush=True)


if __name__ == "__main__":
    main()
