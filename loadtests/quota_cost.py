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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from service.errors import QuotaExceeded
from service.http.quotas import Quotas
from service.settings import ApiKey, Quota


def _best(run: Callable[[], None], calls: int, repeat: int) -> float:
    """The fastest of ``repeat`` rounds of ``calls`` runs, in microseconds per run."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def _case(concurrency: int, held_elsewhere: int, other_keys_held: int, calls: int, repeat: int) -> float:
    keys = [ApiKey(b"measured-key", Quota(concurrency=concurrency))]
    keys += [ApiKey(f"other-key-{i}".encode(), Quota(concurrency=64)) for i in range(-(-other_keys_held // 64))]
    with tempfile.TemporaryDirectory() as folder:
        this, other = Quotas(keys, 16, Path(folder)), Quotas(keys, 16, Path(folder))  # two workers
        measured = keys[0].id
        for _ in range(held_elsewhere):
            other.enter(measured)
        for index in range(other_keys_held):
            other.enter(keys[1 + index // 64].id)

        def admitted() -> None:
            this.enter(measured)
            this.leave(measured)

        def refused() -> None:
            try:
                this.enter(measured)
            except QuotaExceeded:
                return
            raise AssertionError("admitted with every slot held")

        try:
            return _best(refused if held_elsewhere >= concurrency else admitted, calls, repeat)
        finally:
            this.close()
            other.close()


CASES = (
    ("admitted, concurrency=4, nothing held", 4, 0, 0),
    ("admitted, concurrency=64, 48 held by the other worker", 64, 48, 0),
    ("admitted, concurrency=4, 1024 slots of other keys held", 4, 0, 1024),
    ("refused, concurrency=1, held by the other worker", 1, 1, 0),
    ("refused, concurrency=64, all held by the other worker", 64, 64, 0),
    ("refused, concurrency=256 (the most), all held by the other worker", 256, 256, 0),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="requests per round (fewer for slow refusals)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the fastest is reported")
    args = parser.parse_args(argv)
    for label, concurrency, held, others in CASES:
        calls = max(1, args.calls // max(1, concurrency // 8)) if held >= concurrency else args.calls
        print(f"{_case(concurrency, held, others, calls, args.repeat):9.2f} us  {label}")


if __name__ == "__main__":
    main()
