"""What hostile chunked request bodies cost a gateway process: a million one-byte chunks
(``1\\r\\nx\\r\\n`` each, 6 MB on the wire for a 1 MB body, under GATEWAY_MAX_BODY_BYTES), sent as
fast as the socket takes them, by one client or several at once (``--connections``). Reports the
answers and how long they took, the longest /healthz answer meanwhile (from another connection:
the event loop's stall), and the growth of the gateway's peak resident memory (VmHWM).

    python -m loadtests.chunked_body --repeat 3 --baseline ../main   # against another checkout
"""

from __future__ import annotations

import argparse

from loadtests.harness import hostile_body

CHUNKS = 1_000_000
ROUTES = {
    "classify": b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n",
    "v2": b"POST /v2/models/trivial/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n",
    "offline": b"POST /classify?mode=offline HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n",
}


def chunked_request(head: bytes, chunks: int) -> bytes:
    """``head`` with a chunked body of ``chunks`` one-byte chunks."""
    return head + b"transfer-encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * chunks + b"0\r\n\r\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hostile_body.add_arguments(parser)
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--route", choices=sorted(ROUTES), default="classify")
    args = parser.parse_args(argv)
    request = chunked_request(ROUTES[args.route], args.chunks)
    title = f"{args.route}: a chunked body of {args.chunks:,} one-byte chunks ({len(request):,} bytes on the wire)"
    hostile_body.compare(request, args, title)


if __name__ == "__main__":
    main()
