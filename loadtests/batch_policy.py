"""Fixed against adaptive batching on the same load: open-loop (Poisson) arrivals at low, medium
and overload rates, one-image requests of 224 px JPEGs, the gateway on a real model.

    python -m loadtests.batch_policy --seconds 20 --repeat 2

First the gateway's capacity is measured (closed loop, many clients, fixed policy); the rates are
then fractions of it (``--loads 0.3,0.7,1.3``). Each (load, policy) run starts a fresh gateway,
trains it for ``--warmup`` seconds at that rate, then records every request: throughput of 200s,
p50 / p99 latency of the 200s, and how many were refused (429) or timed out (504). Runs are
interleaved across policies within a repetition. Open-loop arrivals keep coming whether or not
earlier requests were answered, as real traffic does; a closed loop of N clients would slow down
with the server and hide the queueing the policies differ on.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from loadtests.harness.deployment import gateway
from loadtests.harness.open_loop import Run, jpeg_224, open_loop
from service.tune.loadgen import closed_loop


def gateway_args(args: argparse.Namespace, policy: str) -> list[str]:
    return [
        "--model",
        args.model,
        "--batch-policy",
        policy,
        "--max-batch-size",
        str(args.batch),
        "--max-delay",
        str(args.max_delay),
        "--max-inflight-batches",
        str(args.inflight),
        "--max-queue-size",
        "1024",
        "--max-concurrent-requests",
        "1024",
        "--max-connections",
        "2048",
        "--request-timeout",
        str(args.timeout),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--loads", default="0.3,0.7,1.3", help="arrival rates as fractions of capacity")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-delay", type=float, default=0.05)
    parser.add_argument("--inflight", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=2.0, help="the gateway's request deadline, seconds")
    parser.add_argument("--capacity", type=float, default=0, help="skip measuring it: images/s")
    parser.add_argument(
        "--p99-target-ms",
        type=float,
        default=0,
        help="also print each policy's throughput at this p99 target: the most answered img/s over the loads "
        "whose median p99 is within it with at most 1 %% refused or timed out",
    )
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args(argv)
    body = jpeg_224()
    capacity = args.capacity
    if not capacity:
        with gateway(gateway_args(args, "fixed"), args.models_dir) as (_, url):
            capacity = asyncio.run(closed_loop(url, [body], 32, 10, warmup=3)).throughput
    loads = [float(x) for x in args.loads.split(",")]
    runs: dict[tuple[float, str], list[Run]] = {}
    for repetition in range(args.repeat):
        for load in loads:
            for policy in ("fixed", "adaptive"):
                with gateway(gateway_args(args, policy), args.models_dir) as (_, url):
                    rate = load * capacity
                    asyncio.run(open_loop(url, body, rate, args.warmup, seed=1000 + repetition))
                    run = asyncio.run(open_loop(url, body, rate, args.seconds, seed=repetition))
                runs.setdefault((load, policy), []).append(run)
    print(
        f"\n{args.model}, capacity {capacity:,.0f} img/s (closed loop, 32 clients); batch {args.batch}, "
        f"max delay {args.max_delay * 1000:g} ms, {args.inflight} in flight, deadline {args.timeout:g} s; "
        f"open-loop Poisson arrivals, {args.seconds:g} s per run after {args.warmup:g} s of warm-up, "
        f"medians of {args.repeat}\n"
    )
    print("| load | offered img/s | policy | answered img/s | p50 ms | p99 ms | 429 | 504 |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for (load, policy), results in runs.items():
        print(
            f"| {load:g}x | {results[0].offered:,.0f} | {policy} "
            f"| {statistics.median(r.throughput for r in results):,.0f} "
            f"| {statistics.median(r.percentile(50) for r in results):,.1f} "
            f"| {statistics.median(r.percentile(99) for r in results):,.1f} "
            f"| {statistics.median(r.share(429) for r in results):.1%} "
            f"| {statistics.median(r.share(504) for r in results):.1%} |"
        )
    if args.p99_target_ms:
        print(f"\nThroughput at p99 <= {args.p99_target_ms:g} ms (loads {args.loads}):\n")
        print("| policy | answered img/s | at load | p99 ms |")
        print("|---|---:|---:|---:|")
        for policy in ("fixed", "adaptive"):
            meeting = [
                (
                    statistics.median(r.throughput for r in results),
                    load,
                    statistics.median(r.percentile(99) for r in results),
                )
                for (load, name), results in runs.items()
                if name == policy
                and statistics.median(r.percentile(99) for r in results) <= args.p99_target_ms
                and statistics.median(r.share(429) + r.share(504) for r in results) <= 0.01
            ]
            if meeting:
                throughput, load, p99 = max(meeting)
                print(f"| {policy} | {throughput:,.0f} | {load:g}x | {p99:,.1f} |")
            else:
                print(f"| {policy} | none met it | | |")


if __name__ == "__main__":
    main()
