"""Fair sharing between models: one model flooded at 5x its capacity while a second gets a steady
0.5x of its own; the second model's latency and errors, with fair sharing (the default) and
without it (``GATEWAY_FAIR_SHARING=false``: one admission limit and one decode queue, first come
first served, which is how a single shared pool behaves).

    python -m loadtests.fairness --seconds 20 --repeat 3

Both models run the fake backend (``--batch`` images per batch, ``--delay`` seconds per batch, one
batch in flight: a capacity of batch/delay images per second each), so the backends themselves do
not compete and what is measured is the gateway's sharing: admission, decode threads, event loop.
Open-loop Poisson arrivals of one 224 px JPEG per request. For each mode and repetition a fresh
gateway: the steady model alone (its unloaded latency), then the flood starts and, 2 s later, the
steady model's load again, both measured for ``--seconds``. Medians over repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from loadtests.harness.http_load import start_gateway, stop_process
from loadtests.harness.open_loop import Run, jpeg_224, open_loop

MODEL = """
[models.{name}]
profile = "trivial"
backend = "fake"
fake_delay = {delay}
max_batch_size = {batch}
max_inflight_batches = 1
max_queue_size = 1024
"""


async def flood_and_steady(
    url: str, body: bytes, flood: float, steady: float, seconds: float, seed: int
) -> tuple[Run, Run]:
    flooded, measured = await asyncio.gather(
        open_loop(url, body, flood, seconds + 2, seed, "/v1/models/flooded/classify"),
        open_loop(url, body, steady, seconds, seed + 1, "/v1/models/steady/classify", start_in=2.0),
    )
    return flooded, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.04, help="seconds per batch of the fake backend")
    parser.add_argument("--flood", type=float, default=5.0, help="the flooded model's load, x its capacity")
    parser.add_argument("--steady", type=float, default=0.5, help="the steady model's load, x its capacity")
    args = parser.parse_args()
    capacity = args.batch / args.delay
    body = jpeg_224()
    work = Path(tempfile.mkdtemp(prefix="fairness-"))
    models = work / "models.toml"
    models.write_text(
        "".join(MODEL.format(name=name, delay=args.delay, batch=args.batch) for name in ("flooded", "steady"))
    )
    runs: dict[str, list[tuple[Run, Run, Run]]] = {"fair": [], "first come": []}
    for repetition in range(args.repeat):
        for mode in runs:
            env = {"GATEWAY_FAIR_SHARING": "true" if mode == "fair" else "false", "GATEWAY_MODELS_FILE": str(models)}
            proc, url = start_gateway(["--max-connections", "4096"], work / "cache", env=env)
            try:
                alone = asyncio.run(
                    open_loop(
                        url, body, args.steady * capacity, args.seconds, 10 * repetition, "/v1/models/steady/classify"
                    )
                )
                flooded, steady = asyncio.run(
                    flood_and_steady(
                        url, body, args.flood * capacity, args.steady * capacity, args.seconds, 10 * repetition + 2
                    )
                )
            finally:
                stop_process(proc)
            runs[mode].append((alone, flooded, steady))
            print(
                f"repetition {repetition + 1}, {mode}: steady p99 {steady.percentile(99):.1f} ms, "
                f"errors {steady.errors}"
            )
    print(
        f"\nTwo models on the fake backend, each {capacity:,.0f} img/s ({args.batch} per batch, "
        f"{args.delay * 1000:g} ms per batch, one in flight); the flooded model offered {args.flood:g}x, "
        f"the steady one {args.steady:g}x; "
        f"{args.seconds:g} s per run, medians of {args.repeat}; GATEWAY_MAX_CONCURRENT_REQUESTS 64\n"
    )
    print("| sharing | model | offered req/s | answered img/s | p50 ms | p99 ms | refused (429) | other errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode, results in runs.items():
        for label, index in (("steady, alone", 0), ("flooded", 1), ("steady, beside the flood", 2)):
            chosen = [result[index] for result in results]
            print(
                f"| {mode} | {label} | {chosen[0].offered:,.0f} "
                f"| {statistics.median(r.throughput for r in chosen):,.0f} "
                f"| {statistics.median(r.percentile(50) for r in chosen):,.1f} "
                f"| {statistics.median(r.percentile(99) for r in chosen):,.1f} "
                f"| {statistics.median(r.share(429) for r in chosen):.1%} "
                f"| {statistics.median(r.errors - r.statuses.get(429, 0) for r in chosen):,.0f} |"
            )
    for mode, results in runs.items():
        ratios = [steady.percentile(99) / alone.percentile(99) for alone, _, steady in results]
        print(f"\n{mode}: the steady model's p99 beside the flood / alone: {statistics.median(ratios):.2f}x (median)")


if __name__ == "__main__":
    main()
