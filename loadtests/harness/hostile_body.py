"""What one hostile request costs a gateway process, measured the same way for every kind of
body (``loadtests.json_body``, ``chunked_body``, ``v2_envelope``): the whole request sent raw by
one client or several at once, the answers and how long they took, the longest /healthz answer
meanwhile (from another connection: the event loop's stall), and the growth of the gateway's peak
resident memory (VmHWM); medians over fresh gateways, this checkout beside another."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtests.harness.deployment import gateway


@dataclass
class Run:
    status: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stall_ms: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (Linux VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every such figure takes."""
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--connections", type=int, default=1, help="clients sending such a request at once")
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree of main) to measure too")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")


def send(port: int, request: bytes) -> str:
    """Send ``request`` whole (or until the gateway stops reading) and read its answer: status and
    error code."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sender = threading.Thread(target=_send_all, args=(sock, request))
        sender.start()
        answer = b""
        sock.settimeout(120)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                    break
        except OSError as exc:  # reset: the gateway closed with the client's bytes unread
            answer = answer or type(exc).__name__.encode()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sender.join()
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else head.decode()
    try:
        return f"{status} {json.loads(body).get('error')}"
    except ValueError:
        return status


def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    try:
        for start in range(0, len(view), 1 << 20):
            sock.sendall(view[start : start + (1 << 20)])
    except OSError:
        pass  # the gateway answered and closed before reading it all


def measure(pid: int, url: str, request: bytes, run: Run, connections: int) -> None:
    """``connections`` clients send ``request`` at once to the gateway (``pid`` at ``url``)."""
    stop = threading.Event()
    worst = [0.0]

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while True:  # at least one probe, the last one started before the answer came
                started = time.perf_counter()
                client.get("/healthz")
                worst[0] = max(worst[0], time.perf_counter() - started)
                if stop.wait(0.01):
                    return

    port = httpx.URL(url).port
    assert port is not None
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/healthz")
    before = peak_rss(pid)
    prober = threading.Thread(target=probe)
    prober.start()
    started = time.perf_counter()
    answers: list[str] = []
    senders = [threading.Thread(target=lambda: answers.append(send(port, request))) for _ in range(connections)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    run.seconds.append(time.perf_counter() - started)
    run.status.append(", ".join(sorted(set(answers))))
    stop.set()
    prober.join()
    run.stall_ms.append(1000 * worst[0])
    run.peak_mib.append((peak_rss(pid) - before) / 2**20)


def compare(request: bytes, args: argparse.Namespace, title: str) -> None:
    """Measure ``request`` on ``args.repeat`` fresh gateways of this checkout (and of
    ``args.baseline``), then print ``title`` and the table of medians."""
    servers: dict[str, Path | None] = {"this checkout": None}
    if args.baseline is not None:
        servers[f"baseline ({args.baseline.name})"] = args.baseline.resolve()
    runs = {name: Run() for name in servers}
    for _ in range(args.repeat):
        for name, cwd in servers.items():
            with gateway(["--model", "trivial", "--backend", "fake"], args.models_dir, cwd) as (pid, url):
                measure(pid, url, request, runs[name], args.connections)
    print(f"\n{title}, {args.connections} client(s) at once, medians of {args.repeat} fresh gateways\n")
    print("| gateway | answer | answered in s | longest /healthz meanwhile, ms | peak RSS growth, MiB |")
    print("|---|---|---:|---:|---:|")
    for name, run in runs.items():
        print(
            f"| {name} | {run.status[0]} | {statistics.median(run.seconds):.2f} | "
            f"{statistics.median(run.stall_ms):.0f} | {statistics.median(run.peak_mib):.0f} |"
        )
