"""The cases of the quota-cost figure (``loadtests.quota_cost``) and how one is measured: a key's
concurrency quota entered and left on the table the worker processes share, while another
instance on the same folder (a second worker) holds some of the slots.

It uses only ``Quotas``' public methods, so the same measure holds for an older checkout.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from service.errors import QuotaExceeded
from service.http.quotas import Quotas
from service.settings.keys import ApiKey, Quota


def _best(run: Callable[[], None], calls: int, repeat: int) -> float:
    """The fastest of ``repeat`` rounds of ``calls`` runs, in microseconds per run."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def measure(concurrency: int, held_elsewhere: int, other_keys_held: int, calls: int, repeat: int) -> float:
    """Microseconds per request of a key with ``concurrency`` slots, ``held_elsewhere`` of them held by
    another worker's ``Quotas`` on the same folder, and ``other_keys_held`` slots of other keys held:
    ``enter`` then ``leave`` where a slot is free, a refused ``enter`` where none is."""
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
