"""``python -m loadtests.loadgen_ceiling``: the load generator's own ceiling on this machine, against
its trivial server (docs/performance/loadgen.md): closed loops of 64 and 1,024 connections from one
and two processes, open loops at two rates, and wrk beside them where it is installed."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile

from loadtests.harness.loadgen import Load, run, trivial_server


def _wrk(url: str, body: bytes, connections: int, threads: int, seconds: float) -> str:
    with tempfile.TemporaryDirectory() as folder:
        payload = os.path.join(folder, "body.bin")
        with open(payload, "wb") as f:
            f.write(body)
        script = os.path.join(folder, "post.lua")
        with open(script, "w") as f:
            f.write(
                f'wrk.method = "POST"\nlocal f = io.open("{payload}", "rb")\nwrk.body = f:read("*all")\n'
                'wrk.headers["content-type"] = "image/jpeg"\n'
            )
        out = subprocess.run(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "-s", script, url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    rate = next(line.split()[1] for line in out.splitlines() if line.startswith("Requests/sec"))
    return f"wrk, {connections} connections x {threads} threads: {float(rate):,.0f} req/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.loadgen_ceiling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=2, help="the generator's processes in the largest run")
    parser.add_argument("--server-processes", type=int, default=2)
    parser.add_argument("--body-bytes", type=int, default=12_000, help="a 224 px JPEG's size")
    args = parser.parse_args(argv)
    body = os.urandom(args.body_bytes)
    with trivial_server(args.server_processes) as server:
        for connections, processes in ((64, 1), (1024, 1), (1024, args.processes)):
            load = Load(server.url, body, connections=connections, processes=processes, seconds=args.seconds)
            print(run(load).line())
        for rate in (2000.0, 8000.0):
            load = Load(server.url, body, connections=256, processes=args.processes, seconds=args.seconds, rate=rate)
            print(run(load).line())
        if shutil.which("wrk"):
            print(_wrk(server.url, body, 1024, args.processes, args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
