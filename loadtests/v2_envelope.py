"""What hostile Open Inference Protocol envelopes cost a gateway process: one 16 MiB body of 4
million empty binary tensor elements under shape [1] (``--kind binary``), or of 4 million tiny JSON
``data`` elements (``--kind json``, 8 MB), sent by one client or several at once
(``--connections``). Reports the answers and how long they took, the longest /healthz answer
meanwhile (from another connection: the event loop's stall), and the growth of the gateway's peak
resident memory (VmHWM).

    python -m loadtests.v2_envelope --kind binary --connections 4 --repeat 3 --baseline ../main
"""

from __future__ import annotations

import argparse
import json
import struct

from loadtests.harness import hostile_body

ELEMENTS = 4_000_000
PATH = b"/v2/models/trivial/infer"


def envelope(kind: str, elements: int) -> bytes:
    """A whole HTTP request whose inference header declares one image and whose tensor holds
    ``elements`` of the smallest elements."""
    if kind == "binary":
        binary = struct.pack("<I", 0) * elements
        tensor = {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(binary)}}
        header = json.dumps({"inputs": [tensor]}).encode()
        body = header + binary
        extra = f"inference-header-content-length: {len(header)}\r\ncontent-type: application/octet-stream\r\n"
    else:
        head = json.dumps({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1]}]}).encode()[:-3]
        body = head + b', "data": [' + b"1," * (elements - 1) + b"1]}]}"
        extra = "content-type: application/json\r\n"
    return b"POST " + PATH + b" HTTP/1.1\r\nhost: x\r\n" + f"{extra}content-length: {len(body)}\r\n\r\n".encode() + body


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hostile_body.add_arguments(parser)
    parser.add_argument("--kind", choices=["binary", "json"], default="binary")
    parser.add_argument("--elements", type=int, default=ELEMENTS)
    args = parser.parse_args(argv)
    request = envelope(args.kind, args.elements)
    title = f"{args.kind}: {args.elements:,} elements under shape [1] ({len(request):,} bytes)"
    hostile_body.compare(request, args, title)


if __name__ == "__main__":
    main()
