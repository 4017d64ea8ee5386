"""What an API replica's memory holds per remembered ``Idempotency-Key``: tracemalloc over
``--keys`` keys, each claimed and settled (all its images confirmed) the way the claims stream
applies them, for submits of 1, 16 and 64 images; next to it, what the byte bound counts.

    python -m loadtests.idempotency_memory --keys 20000
"""

from __future__ import annotations

import argparse
import secrets
import tracemalloc

from service.jobs.idempotency import Entry, IdempotencyLog, fingerprint, key_digest
from service.jobs.topology import Names


def bytes_per_key(keys: int, images: int) -> tuple[float, float]:
    """(measured, counted by the bound) bytes per key."""
    log = IdempotencyLog(Names("memory"), ttl=86400.0, max_bytes=1 << 40, hold=15.0)
    body = fingerprint([(b"image", "image/png", "a.png")] * images, 5).hex()
    entries = []
    for i in range(keys):  # made before measuring: they are the stream's, not the state's
        key, claim = key_digest(b"an api key", f"order-{i:012d}").hex(), secrets.token_hex(16)
        common = {"key": key, "claim": claim, "fingerprint": body, "count": images, "at": 1e10}
        intent = Entry.model_validate({"kind": "intent", **common})
        entries.append((intent, intent.model_copy(update={"kind": "outcome", "published": (1 << images) - 1})))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for intent, outcome in entries:
        log.apply(intent)
        log.apply(outcome)
    measured = (tracemalloc.get_traced_memory()[0] - before) / keys
    tracemalloc.stop()
    assert len(log.states) == keys
    return measured, log.states.currsize / keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=20000)
    args = parser.parse_args()
    print(f"{args.keys} keys, each claimed and settled\n| images per submit | bytes per key | counted by the bound |")
    print("|---:|---:|---:|")
    for images in (1, 16, 64):
        measured, counted = bytes_per_key(args.keys, images)
        print(f"| {images} | {measured:.0f} | {counted:.0f} |")


if __name__ == "__main__":
    main()
