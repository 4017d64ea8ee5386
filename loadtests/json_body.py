"""What one hostile JSON body of image URLs costs a gateway process: 16 MiB of ``{"url": "a"}``
entries (just under GATEWAY_MAX_BODY_BYTES). Reports the answer and how long it took, the
longest /healthz answer meanwhile (from another thread: the event loop's stall), and the growth
of the gateway's peak resident memory (VmHWM).

    python -m loadtests.json_body --repeat 3 --baseline ../main   # against another checkout
"""

from __future__ import annotations

import argparse

from loadtests.harness import hostile_body

ENTRIES = 1_398_000
"""{"url":"a"} entries: 16,776,012 bytes, under the 16 MiB default body limit."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hostile_body.add_arguments(parser)
    args = parser.parse_args(argv)
    body = b'{"images":[' + b",".join([b'{"url":"a"}'] * ENTRIES) + b"]}"
    request = b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + (
        f"content-length: {len(body)}\r\n\r\n".encode() + body
    )
    hostile_body.compare(request, args, f"one JSON body of {len(body):,} bytes ({ENTRIES:,} URL entries)")


if __name__ == "__main__":
    main()
