"""A load generator that is not the limit: many connections over several processes, closed loop or
open loop (Poisson arrivals) without coordinated omission, and its own ceiling measured.

* **Processes**: the load is split over ``processes`` (each with its own event loop, uvloop where
  installed); each opens its part of ``connections`` keep-alive HTTP/1.1 connections before the
  common start time, so connecting is not measured.
* **The client** is a minimal HTTP/1.1 client on asyncio protocols: the request is serialized once,
  the response parsed by httptools (uvicorn's parser). A request costs the generator some tens of
  microseconds of CPU, where aiohttp's client costs hundreds.
* **Closed loop**: every connection sends its next request when its answer arrives (what wrk does):
  the highest throughput the server sustains with that many clients.
* **Open loop**: requests arrive at exponential gaps (``rate`` per second over all processes),
  whether or not earlier ones were answered. Each request's latency runs from the time it was
  *scheduled*, not the time it was sent: a request that waited for a free connection (all busy),
  or for a generator that fell behind, has that wait in its latency. A closed-loop generator
  measures from the send and so leaves out the queueing that a stalled server causes
  (coordinated omission). ``sender_lag_p99_ms`` says how late the generator itself dispatched
  arrivals (its timer and loop, not waiting for connections): over a millisecond, it is near its
  limit.
* **Ceiling**: ``trivial_server`` answers a fixed 200 at once, in several processes; a run against it
  with the same shape (processes, connections, body) is the most this generator does here, printed
  beside a figure so that a figure near it is known to be the generator's, not the server's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np

START_DELAY = 0.2
"""Seconds from the last process being connected to the common start."""
clock = time.monotonic
"""What every time is measured on: nanosecond resolution, shared by the machine's processes (the
event loop's own clock under uvloop counts whole milliseconds)."""
DRAIN_TIMEOUT = 30.0
"""Seconds after the end that answers still due are waited for (then counted as status 0)."""


@dataclass(frozen=True)
class Load:
    """What to send, and how: ``rate`` None is a closed loop."""

    url: str
    body: bytes
    content_type: str = "image/jpeg"
    connections: int = 64
    processes: int = 1
    seconds: float = 10.0
    rate: float | None = None
    seed: int = 0
    warmup: float = 0.0
    """Open loop: seconds of arrivals at ``rate`` before ``seconds`` of measurement, sent and not
    counted (each connection's first requests, the server's first batches of each size)."""

    def request(self) -> bytes:
        parts = urlsplit(self.url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: {self.content_type}\r\n"
            f"content-length: {len(self.body)}\r\n\r\n"
        )
        return head.encode() + self.body

    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


@dataclass
class Result:
    load: Load
    latencies: np.ndarray
    """Seconds, of the answers with status 200 (from the scheduled time in an open loop)."""
    statuses: dict[int, int]
    """Answers by status; 0: no answer (connection error, or none within the drain timeout)."""
    elapsed: float
    """Seconds from the start to the last answer counted (the run's length for throughput)."""
    sender_lag: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Open loop: seconds between each arrival's scheduled time and its dispatch by the generator."""
    waited: int = 0
    """Open loop: arrivals that found every connection busy and waited for one."""
    finished: float = 0.0
    """Seconds from the start to the last answer counted (an open loop's answers may come after
    its ``seconds``: a server that queues, or arrivals that waited for a connection)."""

    @property
    def goodput(self) -> float:
        """Answers 200 per second, over the time it took to get them (``throughput`` divides an
        open loop's by its ``seconds``, the arrivals' time)."""
        span = max(self.load.seconds, self.finished)
        return self.completed / span if span > 0 else 0.0

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.completed / self.elapsed if self.elapsed > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if len(self.latencies) else math.nan

    @property
    def errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status != 200)

    @property
    def sender_lag_p99_ms(self) -> float:
        return float(np.percentile(self.sender_lag, 99)) * 1000 if len(self.sender_lag) else 0.0

    def line(self, label: str = "") -> str:
        mode = f"open {self.load.rate:g}/s" if self.load.rate is not None else "closed"
        extra = (
            f", sender lag p99 {self.sender_lag_p99_ms:.2f} ms, {self.waited} waited for a connection"
            if self.load.rate is not None
            else ""
        )
        return (
            f"{label}{mode}, {self.load.connections} connections x {self.load.processes} processes: "
            f"{self.throughput:,.0f} req/s, p50 {self.percentile_ms(50):.1f} ms, p99 {self.percentile_ms(99):.1f} ms, "
            f"p99.9 {self.percentile_ms(99.9):.1f} ms, {self.errors} errors{extra}"
        )


class _Client(asyncio.Protocol):
    """One keep-alive connection: one request in flight at a time."""

    def __init__(self, request: bytes) -> None:
        import httptools

        self.request = request
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[int] | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a malformed answer: this connection is done
            self._fail(exc)

    def on_message_complete(self) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("closed by the server"))
        if not self.lost.done():
            self.lost.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    async def send(self) -> int:
        assert self.transport is not None
        if self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(self.request)
        return await self.answer


async def _connect(load: Load, request: bytes, count: int) -> list[_Client]:
    loop = asyncio.get_running_loop()
    host, port = load.address()
    clients: list[_Client] = []
    for start in range(0, count, 64):  # in waves: a burst of thousands of SYNs overflows a backlog
        made = await asyncio.gather(
            *(loop.create_connection(lambda: _Client(request), host, port) for _ in range(min(64, count - start)))
        )
        clients.extend(protocol for _, protocol in made)
    return clients


async def _reconnected(load: Load, request: bytes, client: _Client) -> _Client:
    """The connection again, if the server closed it (an error answer may close it)."""
    if client.transport is not None and not client.transport.is_closing():
        return client
    (fresh,) = await _connect(load, request, 1)
    return fresh


async def _closed(load: Load, clients: list[_Client], start: float, end: float) -> dict[str, Any]:
    request = load.request()
    latencies: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    await asyncio.sleep(max(0.0, start - clock()))

    async def run(client: _Client) -> None:
        while (sent := clock()) < end:
            try:
                client = await _reconnected(load, request, client)
                status = await asyncio.wait_for(client.send(), DRAIN_TIMEOUT)
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                statuses[0] += 1
                continue
            statuses[status] += 1
            if status == 200:
                latencies.append(clock() - sent)

    await asyncio.gather(*(run(client) for client in clients))
    return {"latencies": latencies, "statuses": dict(statuses), "last": clock()}


async def _open(load: Load, clients: list[_Client], start: float, end: float, rate: float) -> dict[str, Any]:
    """Poisson arrivals from ``start - load.warmup`` to ``end``; those before ``start`` are not counted."""
    loop = asyncio.get_running_loop()
    request = load.request()
    rng = np.random.default_rng(load.seed)
    latencies: list[float] = []
    lag: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    idle: collections.deque[_Client] = collections.deque(clients)
    backlog: collections.deque[float] = collections.deque()
    """Scheduled times of arrivals waiting for a free connection."""
    waited = 0
    running: set[asyncio.Task[None]] = set()
    last = start

    async def one(client: _Client, scheduled: float) -> None:
        nonlocal last
        while True:
            try:
                client = await _reconnected(load, request, client)
                status = await asyncio.wait_for(client.send(), max(0.001, end + DRAIN_TIMEOUT - clock()))
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                status = 0
            now = clock()
            if scheduled >= start:
                last = max(last, now)
                statuses[status] += 1
                if status == 200:
                    latencies.append(now - scheduled)
            if not backlog:
                idle.append(client)
                return
            scheduled = backlog.popleft()  # the next waiting arrival takes this connection

    def dispatch(scheduled: float) -> None:
        nonlocal waited
        if scheduled >= start:
            lag.append(clock() - scheduled)
        if not idle:
            waited += scheduled >= start
            backlog.append(scheduled)
            return
        task = loop.create_task(one(idle.popleft(), scheduled))
        running.add(task)
        task.add_done_callback(running.discard)

    scheduled = start - load.warmup
    while True:
        scheduled += float(rng.exponential(1 / rate))
        if scheduled >= end:
            break
        delay = scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        dispatch(scheduled)
    while running:
        await asyncio.gather(*list(running))
    if backlog:  # arrivals never sent (every connection stuck until the drain ended)
        statuses[0] += sum(1 for scheduled in backlog if scheduled >= start)
    return {"latencies": latencies, "statuses": dict(statuses), "last": last, "lag": lag, "waited": waited}


def _process(load: Load, part: int, link: multiprocessing.connection.Connection) -> None:
    """One process's share: ``part`` of ``load.processes``. It connects, says so, and starts at the
    time the parent then sends (on the monotonic clock, which every process of the machine shares),
    once every process is connected: however long a process takes to start, none starts late."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    connections = load.connections // load.processes + (part < load.connections % load.processes)
    rate = None if load.rate is None else load.rate / load.processes

    async def main() -> dict[str, Any]:
        request = load.request()
        clients = await _connect(load, request, connections)
        link.send("connected")
        start = float(await asyncio.to_thread(link.recv))
        end = start + load.seconds
        if rate is None:
            found = await _closed(load, clients, start, end)
        else:
            mine = replace(load, seed=load.seed * 1000 + part)
            await asyncio.sleep(max(0.0, start - load.warmup - clock()))
            found = await _open(mine, clients, start, end, rate)
        found["last"] -= start
        for client in clients:
            if client.transport is not None:
                client.transport.close()
        return found

    try:
        link.send(asyncio.run(main()))
    except BaseException as exc:
        link.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        link.close()


def run(load: Load) -> Result:
    """Run ``load`` from ``load.processes`` processes and gather what they measured."""
    context = multiprocessing.get_context("spawn")  # no inherited event loop or threads
    links, workers = [], []
    for part in range(load.processes):
        mine, theirs = context.Pipe()
        worker = context.Process(target=_process, args=(load, part, theirs), daemon=True)
        worker.start()
        theirs.close()
        links.append(mine)
        workers.append(worker)
    ready = [link.recv() for link in links]  # each connected (or failed: its error)
    start_at = clock() + START_DELAY + (load.warmup if load.rate is not None else 0.0)
    for link in links:
        if ready != ["connected"] * len(links):
            break
        link.send(start_at)
    found = ready if ready != ["connected"] * len(links) else [link.recv() for link in links]
    errors = [f["error"] for f in found if isinstance(f, dict) and "error" in f]
    for worker in workers:
        if errors:
            worker.kill()  # the others wait for a start that will not come
        worker.join(10)
    if errors:
        raise RuntimeError(f"load generator process failed: {errors[0]}")
    statuses: collections.Counter[int] = collections.Counter()
    for f in found:
        statuses.update(f["statuses"])
    return Result(
        load=load,
        latencies=np.array([x for f in found for x in f["latencies"]], dtype=np.float64),
        statuses=dict(statuses),
        elapsed=max(load.seconds, max(f["last"] for f in found)) if load.rate is None else load.seconds,
        sender_lag=np.array([x for f in found for x in f.get("lag", [])], dtype=np.float64),
        waited=sum(f.get("waited", 0) for f in found),
        finished=max(f["last"] for f in found),
    )


# -- the trivial server: the generator's ceiling ---------------------------------------------------

ANSWER = b'{"results":[]}'


class _Trivial(asyncio.Protocol):
    """Answers every request with a fixed 200 (keep-alive), or after the freeze it is told of."""

    first: float | None = None
    """When this process's first request arrived (the freeze is counted from it)."""

    def __init__(self, freeze: tuple[float, float] | None, accepted: Any) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.freeze = freeze
        self.accepted = accepted

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        with self.accepted.get_lock():
            self.accepted.value += 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(ANSWER),
            ANSWER,
        )
        assert self.transport is not None
        if self.freeze is not None:
            now = time.monotonic()
            if _Trivial.first is None:
                _Trivial.first = now
            frozen_from, frozen_until = (_Trivial.first + offset for offset in self.freeze)
            if frozen_from <= now < frozen_until:
                asyncio.get_running_loop().call_later(frozen_until - now, self._write, answer)
                return
        self.transport.write(answer)

    def _write(self, answer: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)


def _serve(port: int, freeze: tuple[float, float] | None, accepted: Any, ready: Any) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    async def main() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(4096)
        server = await asyncio.get_running_loop().create_server(lambda: _Trivial(freeze, accepted), sock=sock)
        ready.release()
        await server.serve_forever()

    asyncio.run(main())


@dataclass
class TrivialServer:
    url: str
    accepted: Any
    """Connections accepted so far, over all its processes (a shared counter)."""


@contextlib.contextmanager
def trivial_server(processes: int = 1, freeze: tuple[float, float] | None = None) -> Iterator[TrivialServer]:
    """A server that answers a fixed 200 at once, from ``processes`` processes on one port
    (SO_REUSEPORT); ``freeze``: (from, until), seconds after its first request, during which
    answers wait (a stalled server, for the open loop's measure of it)."""
    context = multiprocessing.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    accepted = context.Value("q", 0)
    ready = context.Semaphore(0)
    servers = [
        context.Process(target=_serve, args=(port, freeze, accepted, ready), daemon=True) for _ in range(processes)
    ]
    for server in servers:
        server.start()
    try:
        for _ in servers:
            if not ready.acquire(timeout=30):
                raise RuntimeError("the trivial server did not start")
        yield TrivialServer(f"http://127.0.0.1:{port}/classify", accepted)
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.join(10)


def ceiling(load: Load, server_processes: int | None = None) -> Result:
    """``load``'s shape (connections, processes, body; a closed loop) against the trivial server:
    the most this generator does on this machine."""
    with trivial_server(server_processes or max(1, load.processes)) as server:
        return run(replace(load, url=server.url, rate=None))


def find_rate(
    load: Load,
    p99_ms: float,
    low: float,
    high: float,
    steps: int = 6,
    measure: Callable[[Load], Result] | None = None,
    climb: float | None = None,
    rest: float = 0.0,
) -> tuple[float, list[Result]]:
    """The highest open-loop rate in [low, high) whose p99 stays within ``p99_ms`` with no errors, in
    ``steps`` runs (the first at ``low``); the runs, for the report. 0.0 when even ``low`` misses.

    By bisection; or, with ``climb`` (a factor over 1), up from ``low`` by that factor until a run
    misses, then by bisection between the last rate met and the first missed: no run goes far past
    what the server can take, whose backlog would be the next run's. ``rest``: seconds between runs,
    for the server to drain. ``measure``: what runs each step (default ``run``; e.g. one that also
    reads the server's metrics around it)."""
    runs: list[Result] = []
    best, rate, missed = 0.0, low, False
    for step in range(steps):
        if step and rest > 0:
            time.sleep(rest)
        result = (measure or run)(replace(load, rate=rate))
        runs.append(result)
        if result.errors == 0 and result.percentile_ms(99) <= p99_ms:
            best = low = rate
        elif step == 0:
            return 0.0, runs
        else:
            high, missed = rate, True
        rate = low * climb if climb is not None and not missed and low * climb < high else (low + high) / 2
    return best, runs
