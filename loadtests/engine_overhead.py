"""The shared engine's own cost per image: a real engine process with the fake backend (no model)
and one worker's ``EngineClient`` sending batches with ``--slots`` in flight, as a worker's batcher
does. What is measured is the wire: the socket round trip, the engine's batcher and the scores'
way back, with the images either decoded into the worker's cells (``cells``: sent as cell numbers)
or elsewhere (``copied``: copied into a batch slot first, off the event loop), side by side.

``python -m loadtests.engine_overhead [--batch 1,16] [--seconds 5] [--slots 2] [--timeout 10] [--images cells,copied]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from service.backends.engine import EngineClient, Geometry
from service.models.profiles import get_profile


def start_engine(path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GATEWAY_BACKEND": "fake", "GATEWAY_MODEL": "trivial", "GATEWAY_MAX_BATCH_SIZE": "64"}
    process = subprocess.Popen([sys.executable, "-m", "service", "engine", "--socket", str(path)], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a benchmark's start: any version of the engine, however it says it is up
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
            return process
        except OSError:
            time.sleep(0.05)
        finally:
            probe.close()
    process.kill()
    raise SystemExit("the engine did not listen within 60 s")


async def measure(path: Path, batch: int, seconds: float, slots: int, timeout: float | None, images: str) -> float:
    """Microseconds per image."""
    profile = get_profile("trivial")
    client = EngineClient(str(path), Geometry(profile.height, profile.outputs), max_batch_size=batch, slots=slots)
    await client.start()
    shape = (*profile.input_size, 3)
    batches = []
    for _ in range(slots):  # one batch per caller, as each of a worker's batches has its own images
        arrays = []
        for i in range(batch):
            cell = client.allocate_image() if images == "cells" else None
            array = cell if cell is not None else np.empty(shape, np.uint8)
            array[...] = i
            arrays.append(array)
        batches.append(arrays)
    done = 0

    async def sender(until: float, images: list[np.ndarray]) -> None:
        nonlocal done
        while time.perf_counter() < until:
            await client.infer(images, timeout=timeout)
            done += batch

    try:
        await asyncio.gather(*(sender(time.perf_counter() + 1.0, images) for images in batches))  # warm-up
        done = 0
        started = time.perf_counter()
        await asyncio.gather(*(sender(started + seconds, images) for images in batches))
        return (time.perf_counter() - started) / done * 1e6
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0, help="each call's deadline, as the batcher passes it")
    parser.add_argument("--images", default="cells,copied", help="decoded into the worker's cells, or copied")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "engine.sock"
        engine = start_engine(path)
        try:
            for batch in (int(b) for b in args.batch.split(",")):
                for images in args.images.split(","):
                    us = asyncio.run(measure(path, batch, args.seconds, args.slots, args.timeout, images))
                    print(f"batch {batch:3d}, {images:6s}: {us:7.1f} us per image ({1e6 / us:,.0f} img/s)")
        finally:
            engine.terminate()
            engine.wait(30)


if __name__ == "__main__":
    main()
