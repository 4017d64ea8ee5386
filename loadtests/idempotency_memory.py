"""What an API replica's memory holds per remembered ``Idempotency-Key``: tracemalloc over
``--keys`` keys, each claimed and settled (all its images confirmed) the way the claims stream
applies them, for submits of 1, 16 and 64 images; next to it, what the byte bound counts.

    python -m loadtests.idempotency_memory --keys 20000
"""

from __future__ import annotations

import argparse

from loadtests.harness.idempotency import bytes_per_key


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
