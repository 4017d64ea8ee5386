"""What one hostile JSON body of image URLs costs a gateway process: 16 MiB of ``{"url": "a"}``
entries (just under GATEWAY_MAX_BODY_BYTES). Reports the answer and how long it took, the
longest /healthz answer meanwhile (from another thread: the event loop's stall), and the growth
of the gateway's peak resident memory (VmHWM).

    python -m loadtests.json_body --repeat 3 --baseline ../main   # against another checkout
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtests.harness.deployment import gateway

ENTRIES = 1_398_000
"""{"url":"a"} entries: 16,776,012 bytes, under the 16 MiB default body limit."""


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


def measure(pid: int, url: str, body: bytes, run: Run) -> None:
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

    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/healthz")
        before = peak_rss(pid)
        prober = threading.Thread(target=probe)
        prober.start()
        started = time.perf_counter()
        answer = client.post("/classify", content=body, headers={"content-type": "application/json"})
        run.seconds.append(time.perf_counter() - started)
        stop.set()
        prober.join()
    run.status.append(f"{answer.status_code} {answer.json().get('error')}")
    run.stall_ms.append(1000 * worst[0])
    run.peak_mib.append((peak_rss(pid) - before) / 2**20)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree of main) to measure too")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args(argv)
    body = b'{"images":[' + b",".join([b'{"url":"a"}'] * ENTRIES) + b"]}"
    servers: dict[str, Path | None] = {"this checkout": None}
    if args.baseline is not None:
        servers[f"baseline ({args.baseline.name})"] = args.baseline.resolve()
    runs = {name: Run() for name in servers}
    for _ in range(args.repeat):
        for name, cwd in servers.items():
            with gateway(["--model", "trivial", "--backend", "fake"], args.models_dir, cwd) as (pid, url):
                measure(pid, url, body, runs[name])
    print(
        f"\none JSON body of {len(body):,} bytes ({ENTRIES:,} URL entries), medians of {args.repeat} fresh gateways\n"
    )
    print("| gateway | answer | answered in s | longest /healthz meanwhile, ms | peak RSS growth, MiB |")
    print("|---|---|---:|---:|---:|")
    for name, run in runs.items():
        print(
            f"| {name} | {run.status[0]} | {statistics.median(run.seconds):.2f} | "
            f"{statistics.median(run.stall_ms):.0f} | {statistics.median(run.peak_mib):.0f} |"
        )


if __name__ == "__main__":
    main()
