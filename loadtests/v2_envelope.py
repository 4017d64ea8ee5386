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
import statistics
import struct
import tempfile
from pathlib import Path

from loadtests.chunked_body import Run, measure
from loadtests.harness.deployment import gateway

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
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kind", choices=["binary", "json"], default="binary")
    parser.add_argument("--elements", type=int, default=ELEMENTS)
    parser.add_argument("--connections", type=int, default=1, help="clients sending such a body at once")
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree of main) to measure too")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    args = parser.parse_args(argv)
    request = envelope(args.kind, args.elements)
    servers: dict[str, Path | None] = {"this checkout": None}
    if args.baseline is not None:
        servers[f"baseline ({args.baseline.name})"] = args.baseline.resolve()
    runs = {name: Run() for name in servers}
    for _ in range(args.repeat):
        for name, cwd in servers.items():
            with gateway(["--model", "trivial", "--backend", "fake"], args.models_dir, cwd) as (pid, url):
                measure(pid, url, request, runs[name], args.connections)
    print(
        f"\n{args.kind}: {args.connections} client(s) each sending {args.elements:,} elements under shape [1] "
        f"({len(request):,} bytes), medians of {args.repeat} fresh gateways\n"
    )
    print("| gateway | answer | answered in s | longest /healthz meanwhile, ms | peak RSS growth, MiB |")
    print("|---|---|---:|---:|---:|")
    for name, run in runs.items():
        print(
            f"| {name} | {run.status[0]} | {statistics.median(run.seconds):.2f} | "
            f"{statistics.median(run.stall_ms):.0f} | {statistics.median(run.peak_mib):.0f} |"
        )


if __name__ == "__main__":
    main()
