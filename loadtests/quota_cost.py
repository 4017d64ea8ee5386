"""What a key's concurrency quota costs per request, in microseconds: ``Quotas.enter`` then
``leave`` (what the API-key middleware runs around every request of a key with ``concurrency=``),
on the table the worker processes share, while another instance on the same folder (a second
worker) holds some of the slots.

    python -m loadtests.quota_cost --calls 20000 --repeat 5

It uses only ``Quotas``' public methods, so the same command measures an older checkout (run it
with that checkout first on ``PYTHONPATH``) for a before/after figure.
"""

from __future__ import annotations

import argparse

from loadtests.harness.quota_cases import CASES, measure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="requests per round (fewer for slow refusals)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the fastest is reported")
    args = parser.parse_args(argv)
    for label, concurrency, held, others in CASES:
        calls = max(1, args.calls // max(1, concurrency // 8)) if held >= concurrency else args.calls
        print(f"{measure(concurrency, held, others, calls, args.repeat):9.2f} us  {label}")


if __name__ == "__main__":
    main()
