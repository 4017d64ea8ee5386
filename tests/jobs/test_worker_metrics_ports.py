"""Several queue workers on one host each serve their own /metrics (``service.jobs.exposition``)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from service.jobs.exposition import serve_metrics
from service.jobs.topology import Names
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL, collect_results, gateway_process, job, publish

PORT_LINE = re.compile(r"worker: metrics on port (\d+)")


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        with ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


@contextmanager
def listening(port: int) -> Iterator[None]:
    """Another process's server on ``port`` (a socket listening there, as servers bind: with
    SO_REUSEADDR, so a port whose last connections are in TIME_WAIT can be taken)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield


def started(proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> int:
    """Wait for a worker to say it is ready; the port its metrics are on (from its log). Fails at
    once, with its log, if it exits instead."""
    deadline = time.monotonic() + timeout
    while "worker ready" not in (text := log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"the worker exited with {proc.returncode}:\n{text[-3000:]}"
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.1)
    ports = PORT_LINE.findall(text)
    assert len(ports) == 1, text[-3000:]
    return int(ports[0])


def acked(text: str) -> float:
    match = re.search(r'^gateway_queue_messages_total\{event="acked"\} (\S+)$', text, re.MULTILINE)
    assert match, text[:2000]
    return float(match.group(1))


async def test_two_workers_on_one_host_each_serve_their_own_metrics(
    prefix: str, models_dir: Path, tmp_path: Path
) -> None:
    """Two real ``gateway worker`` processes with the same settings on one host (docs/routing.md
    starts two so): both start, the first on the first port of the range and the second on the
    next, each saying so in its log, and the two /metrics count the jobs each acked, all of them
    between them. Before, the second died at start with ``OSError: [Errno 98] Address already in
    use`` on the metrics port."""
    first = free_ports(4)
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_LOG_LEVEL": "info",
        "GATEWAY_WORKER_METRICS_PORT": str(first),
    }
    names = Names(prefix)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for i in range(2):
            log = tmp_path / f"worker-{i}.log"
            workers.append(gateway_process(["worker"], {**env, "GATEWAY_WORKER_HEARTBEAT_FILE": str(log) + ".hb"}, log))
            ports.append(await asyncio.to_thread(started, workers[-1], log))
        assert ports == [first, first + 1]
        await publish(names, *(job(v, f"m-{v}") for v in range(20)))
        assert len(await collect_results(names, 20)) == 20
        async with httpx.AsyncClient(timeout=10) as client:
            texts = [(await client.get(f"http://127.0.0.1:{port}/metrics")).text for port in ports]
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(timeout=60)
    assert sum(acked(text) for text in texts) == 20
    assert all(proc.returncode == 0 for proc in workers)


def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("probe", "a metric to find", registry=registry).inc()
    return registry


def test_a_port_in_use_is_passed_over_and_a_closed_endpoint_frees_its_port() -> None:
    """With the range's first port held by another server, the endpoint takes the next and serves
    the registry there; once closed, its port can be bound again (a worker that stops frees it)."""
    first = free_ports(3)
    settings = Settings(worker_metrics_port=first, worker_metrics_ports=3)
    with listening(first):
        endpoint = serve_metrics(settings, registry())
        assert endpoint is not None
        try:
            assert endpoint.port == first + 1
            assert "probe_total 1.0" in httpx.get(f"http://127.0.0.1:{endpoint.port}/metrics").text
        finally:
            endpoint.close()
    with listening(first + 1):
        pass


def test_a_range_all_in_use_stops_the_worker_naming_the_settings() -> None:
    """Every port of the range taken: the worker stops with a message that names the ports and the
    settings to change, not a traceback."""
    first = free_ports(2)
    settings = Settings(worker_metrics_port=first, worker_metrics_ports=2)
    with listening(first), listening(first + 1), pytest.raises(SystemExit) as stopped:
        serve_metrics(settings, registry())
    message = str(stopped.value)
    assert f"every metrics port from {first} to {first + 1} is in use" in message
    assert "GATEWAY_WORKER_METRICS_PORTS" in message
    assert "GATEWAY_WORKER_METRICS_PORT " in message


def test_port_0_serves_no_metrics() -> None:
    assert serve_metrics(Settings(worker_metrics_port=0), registry()) is None
