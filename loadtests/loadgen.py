"""``python -m loadtests.loadgen URL --body FILE``: load a server with many connections from several
processes, closed loop or open loop (Poisson, without coordinated omission), and print the
generator's own ceiling beside the figure (``loadtests.harness.loadgen``).

    # closed loop, 1024 connections over 4 processes, 10 s; the ceiling against a trivial server too
    python -m loadtests.loadgen http://127.0.0.1:8000/classify --body cat.jpg --connections 1024 \\
        --processes 4 --ceiling
    # open loop at 2,000 requests/s
    python -m loadtests.loadgen http://127.0.0.1:8000/classify --body cat.jpg --rate 2000
    # the highest Poisson rate whose p99 stays within 15 ms (MLPerf's server bound)
    python -m loadtests.loadgen http://127.0.0.1:8000/classify --body cat.jpg --find-rate 100:20000 --p99-ms 15
"""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtests.harness.loadgen import Load, ceiling, find_rate, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="where to POST, e.g. http://127.0.0.1:8000/classify")
    parser.add_argument("--body", type=Path, required=True, help="the request body (an image)")
    parser.add_argument("--content-type", default="image/jpeg")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, help="open loop: requests per second (Poisson); default: closed loop")
    parser.add_argument(
        "--warmup", type=float, default=0.0, help="open loop: seconds of arrivals sent before measuring, not counted"
    )
    parser.add_argument("--find-rate", metavar="LOW:HIGH", help="search the highest rate within --p99-ms")
    parser.add_argument("--p99-ms", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=6, help="runs of the --find-rate search")
    parser.add_argument("--ceiling", action="store_true", help="also run the same shape against a trivial server")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup <= 3600:
        parser.error("--warmup must be between 0 and 3600 seconds")
    if args.connections < args.processes or args.processes < 1:
        parser.error("--connections must be at least --processes, which must be at least 1")
    load = Load(
        args.url,
        args.body.read_bytes(),
        args.content_type,
        connections=args.connections,
        processes=args.processes,
        seconds=args.seconds,
        rate=args.rate,
        warmup=args.warmup,
    )
    if args.find_rate:
        low, _, high = args.find_rate.partition(":")
        best, runs = find_rate(load, args.p99_ms, float(low), float(high), args.steps)
        for result in runs:
            print(result.line("  "))
        print(f"highest rate with p99 <= {args.p99_ms:g} ms and no errors: {best:,.0f} requests/s")
    else:
        print(run(load).line())
    if args.ceiling:
        print(ceiling(load).line("generator ceiling (trivial server): "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
