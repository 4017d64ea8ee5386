"""A real shared-engine process (``gateway engine``) for tests, with the fake backend by default,
and a worker's client to it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import numpy as np

from service.backends.engine import EngineClient, Geometry
from service.models.profiles import get_profile

MODEL = "trivial"
PROFILE = get_profile(MODEL)
GEOMETRY = Geometry(PROFILE.height, PROFILE.outputs)


def images(*classes: int) -> list[np.ndarray]:
    """Images whose fake-backend answer is ``classes`` (the first pixel's red value)."""
    out = []
    for c in classes:
        img = np.zeros((GEOMETRY.image_size, GEOMETRY.image_size, 3), np.uint8)
        img[0, 0, 0] = c
        out.append(img)
    return out


@contextmanager
def engine_process(
    socket: Path, backend: str = "fake", *, open_files: int | None = None, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """``gateway engine --socket SOCKET``, returned once it listens (it says so on a pipe);
    SIGKILLed at the end if still running. ``open_files``: its limit of open file descriptors."""

    def limit() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    read_end, write_end = os.pipe()
    environment = {**os.environ, "GATEWAY_BACKEND": backend, "GATEWAY_MODEL": MODEL, **env}
    command = [sys.executable, "-m", "service", "engine", "--socket", str(socket), "--ready-fd", str(write_end)]
    process = subprocess.Popen(command, env=environment, pass_fds=(write_end,), preexec_fn=limit)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as ready:
            assert ready.read(1) == b"1", f"the engine exited with {process.wait()} before listening"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@asynccontextmanager
async def engine_client(
    socket: Path, *, slots: int = 2, max_batch_size: int = 4, **options: float
) -> AsyncIterator[EngineClient]:
    client = EngineClient(str(socket), GEOMETRY, max_batch_size=max_batch_size, slots=slots, **options)
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()
