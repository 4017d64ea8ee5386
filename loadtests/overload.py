"""Overload drill: 10x more concurrent clients than the gateway admits, against a slow backend.

Reports the gateway's peak resident memory against its documented bound, how fast excess requests
are refused (429), whether admitted requests meet their deadline, and whether it recovers.

    python -m loadtests.overload --seconds 30
"""

from __future__ import annotations

import argparse
import statistics

from loadtests.harness.overload import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--admitted", type=int, default=32, help="GATEWAY_MAX_CONCURRENT_REQUESTS")
    parser.add_argument("--factor", type=int, default=10, help="clients = admitted x factor")
    args = parser.parse_args()
    report = run(args.seconds, args.admitted, args.factor)
    print("\n".join(report.lines()))
    print(
        f"429s per second: {report.statuses.get(429, 0) / args.seconds:.0f}; "
        f"median 200 latency {statistics.median(report.accepted_ms or [0]):.0f} ms"
    )


if __name__ == "__main__":
    main()
