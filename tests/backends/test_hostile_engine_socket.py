"""Hostile input on the shared engine's Unix socket: any local process that can reach the socket
can send it bytes and file descriptors. A real engine process (the fake backend) must close each
such connection, never crash or read outside a worker's block, and keep serving a well-behaved
worker all along."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import psutil
import pytest

from service.backends.engine import _HELLO, _MAGIC, _READY, _REQUEST, HELLO_TIMEOUT, MAX_CELLS, create_block
from service.errors import DeadlineExceeded
from tests.backends.engine_process import GEOMETRY, engine_client, engine_process, images

pytestmark = pytest.mark.slow  # every test starts the shared engine as a process of its own

SLOTS, PER_SLOT = 2, 4
CELLS = 3 * SLOTS * PER_SLOT  # a worker's: its slots, and a pool of twice as many cells
BLOCK_BYTES = CELLS * GEOMETRY.image_bytes


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    socket_path = tmp_path_factory.mktemp("engine") / "engine.sock"
    with engine_process(socket_path) as process:
        yield socket_path, process


def hello(cells: int = CELLS, per_call: int = PER_SLOT, image_bytes: int = GEOMETRY.image_bytes) -> bytes:
    return _HELLO.pack(_MAGIC, cells, per_call, image_bytes)


def request(request_id: int, *cells: int, count: int | None = None) -> bytes:
    """A call for the images in ``cells`` (``count``: what the header says, if not their number)."""
    header = _REQUEST.pack(request_id, len(cells) if count is None else count, 0.0)
    return header + b"".join(cell.to_bytes(4, "little") for cell in cells)


async def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, str(path))
    return sock


async def closed_by_engine(sock: socket.socket, within: float = 10.0) -> None:
    """Return once the engine has closed ``sock`` (whatever it said before)."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(within):
        while True:
            try:
                if not await loop.sock_recv(sock, 65536):
                    break
            except ConnectionResetError:
                break
    sock.close()


async def still_serving(engine: tuple[Path, subprocess.Popen[bytes]]) -> None:
    """The engine process is alive and a well-behaved worker gets its answers."""
    path, process = engine
    assert process.poll() is None, f"the engine died with {process.returncode}"
    async with engine_client(path, slots=SLOTS, max_batch_size=PER_SLOT) as worker:
        assert await worker.ready() is None
        assert list((await worker.infer(images(7, 8), timeout=30)).argmax(axis=1)) == [7, 8]


def memfd(size: int, *, sealed: bool = True) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def regular_file(tmp_path: Path) -> int:
    path = tmp_path / "block"
    path.write_bytes(bytes(BLOCK_BYTES))
    return os.open(path, os.O_RDWR)


def dev_shm_block(tmp_path: Path) -> int:
    """A block with a name in /dev/shm (the old wire's kind): it can be truncated under a reader."""
    block = shared_memory.SharedMemory(create=True, size=BLOCK_BYTES)
    fd = os.dup(block._fd)  # type: ignore[attr-defined]
    block.close()
    block.unlink()
    return fd


def pipe(tmp_path: Path) -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


HOSTILE_HELLOS = {
    "wrong magic": (b"HTTP" + hello()[4:], ["memfd"]),
    "the previous wire's magic": (b"GWE2" + hello()[4:], ["memfd"]),
    "no file descriptor": (hello(), []),
    "two file descriptors": (hello(), ["memfd", "memfd"]),
    "a regular file": (hello(), ["file"]),
    "a /dev/shm block": (hello(), ["dev_shm"]),
    "a pipe": (hello(), ["pipe"]),
    "an unsealed memfd": (hello(), ["unsealed"]),
    "a sealed memfd too small for its cells": (hello(), ["small"]),
    "images of another size": (hello(image_bytes=12), ["memfd"]),
    "no cells": (hello(cells=0), ["memfd"]),
    "more cells than any worker has": (hello(cells=MAX_CELLS + 1), ["memfd"]),
    "huge cell count": (hello(cells=2**32 - 1), ["memfd"]),
    "no images per call": (hello(per_call=0), ["memfd"]),
    "huge images per call": (hello(per_call=2**32 - 1), ["memfd"]),
    "random bytes": (random.Random(31).randbytes(_HELLO.size), ["memfd"]),
}


def make_fd(kind: str, tmp_path: Path) -> int:
    makers = {
        "memfd": lambda: memfd(BLOCK_BYTES),
        "unsealed": lambda: memfd(BLOCK_BYTES, sealed=False),
        "small": lambda: memfd(BLOCK_BYTES // 2),
        "file": lambda: regular_file(tmp_path),
        "dev_shm": lambda: dev_shm_block(tmp_path),
        "pipe": lambda: pipe(tmp_path),
    }
    return makers[kind]()


@pytest.mark.parametrize("case", list(HOSTILE_HELLOS))
async def test_a_hello_the_engine_does_not_serve_closes_the_connection(
    engine: tuple[Path, subprocess.Popen[bytes]], tmp_path: Path, case: str
) -> None:
    """A HELLO with the wrong magic, sizes out of range, or anything but one sealed memory file
    big enough for its cells (a regular file, a /dev/shm block, a pipe, an unsealed or short
    memfd: each could be truncated under the engine's reads, or is not memory at all): the engine
    closes the connection without mapping it, and serves the next worker."""
    data, kinds = HOSTILE_HELLOS[case]
    fds = [make_fd(kind, tmp_path) for kind in kinds]
    sock = await connect(engine[0])
    try:
        socket.send_fds(sock, [data], fds)
    finally:
        for fd in fds:
            os.close(fd)
    await closed_by_engine(sock)
    await still_serving(engine)


BAD_REQUESTS = {
    "a cell just past the block": request(1, CELLS),
    "a cell past the block after good ones": request(1, 0, 1, CELLS + 5),
    "huge cell": request(1, 2**32 - 1),
    "no images": request(1),
    "more images than a call may carry": request(1, *range(PER_SLOT + 1)),
    "huge image count": request(1, 0, count=2**32 - 1),
    "more calls at once than cells": b"".join(request(i, 0) for i in range(CELLS + 1)),
    "more images at once than cells, one cell named again and again": b"".join(
        request(i, *[0] * PER_SLOT) for i in range(CELLS // PER_SLOT + 1)
    ),
    "random bytes": random.Random(13).randbytes(4096),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_a_request_outside_the_block_closes_the_connection(
    engine: tuple[Path, subprocess.Popen[bytes]], case: str
) -> None:
    """After a good HELLO, a request naming a cell outside the block or more images than a call
    may carry (or more calls at once than cells, which a worker never sends): the engine reads
    nothing outside the block, closes that connection, and serves the next worker."""
    fd = memfd(BLOCK_BYTES)
    sock = await connect(engine[0])
    try:
        socket.send_fds(sock, [hello()], [fd])
    finally:
        os.close(fd)
    loop = asyncio.get_running_loop()
    (length,) = _READY.unpack(await loop.sock_recv(sock, _READY.size))  # served: it mapped the block
    assert length > 0
    await loop.sock_sendall(sock, BAD_REQUESTS[case])
    await closed_by_engine(sock)
    await still_serving(engine)


async def test_silent_truncated_and_vanishing_clients_hold_nothing(
    engine: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    """A client that connects and says nothing, one that sends half a HELLO and waits, one that
    sends half a HELLO and goes, one that goes in the middle of a request's header and one in the
    middle of its list of cells: a worker is served while they hang on, and the engine closes the
    silent ones at the HELLO deadline."""
    loop = asyncio.get_running_loop()
    silent = await connect(engine[0])
    half_hello = await connect(engine[0])
    await loop.sock_sendall(half_hello, hello()[:7])
    gone = await connect(engine[0])
    await loop.sock_sendall(gone, hello()[:7])
    gone.close()
    for cut in (5, _REQUEST.size + 5):
        mid_request = await connect(engine[0])
        fd = memfd(BLOCK_BYTES)
        try:
            socket.send_fds(mid_request, [hello() + request(1, 0, 1)[:cut]], [fd])
        finally:
            os.close(fd)
        await loop.sock_recv(mid_request, 65536)  # its READY
        mid_request.close()
    await still_serving(engine)
    await asyncio.gather(closed_by_engine(silent, HELLO_TIMEOUT + 10), closed_by_engine(half_hello, HELLO_TIMEOUT + 10))
    await still_serving(engine)


def test_a_workers_block_cannot_be_shrunk_under_the_engine() -> None:
    """The worker's block is sealed: truncating it (which would make the engine's next read a
    SIGBUS) or growing it fails in the kernel."""
    fd, block = create_block(BLOCK_BYTES)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, BLOCK_BYTES * 2)
    finally:
        block.close()
        os.close(fd)


async def test_running_out_of_file_descriptors_does_not_stop_the_engine_listening(tmp_path: Path) -> None:
    """Clients holding as many connections as the engine may open files (its RLIMIT_NOFILE): the
    connections over the limit wait in the backlog, and once those clients go, the engine accepts
    and serves a worker again; running out of descriptors once must not leave a live engine that
    no longer listens (which its supervisor would never restart)."""
    socket_path, limit = tmp_path / "engine.sock", 64
    with engine_process(socket_path, open_files=limit) as process:
        loop = asyncio.get_running_loop()
        engine_fds = f"/proc/{process.pid}/fd"
        held = []
        async with asyncio.timeout(30):
            while len(os.listdir(engine_fds)) < limit:  # until the engine holds all it may
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, str(socket_path))
                except BlockingIOError:  # the backlog is full: the engine accepts meanwhile
                    sock.close()
                    await asyncio.sleep(0.05)
                    continue
                except ConnectionRefusedError:  # no longer listening
                    sock.close()
                    break
                held.append(sock)
        for sock in held:
            sock.close()
        await still_serving((socket_path, process))


async def test_a_worker_gone_while_its_images_are_in_a_running_batch_does_not_crash_the_engine(
    tmp_path: Path,
) -> None:
    """A worker whose connection ends (its call timed out and it closed; a SIGKILLed worker) while
    a batch with its images is still running in the engine: the engine keeps its view of that
    worker's block until the batch is done with it (unmapping it under the batch was a SIGSEGV
    that took every worker's calls down, or a read of whatever was mapped there next), and another
    worker's call queued behind that batch is answered."""
    socket_path = tmp_path / "engine.sock"
    with engine_process(socket_path, GATEWAY_FAKE_DELAY="2") as process:  # a batch reads its images after 2 s
        async with engine_client(socket_path, slots=SLOTS, max_batch_size=PER_SLOT) as other:
            async with engine_client(socket_path, slots=SLOTS, max_batch_size=PER_SLOT) as gone:
                with pytest.raises(DeadlineExceeded):
                    await gone.infer(images(3), timeout=0.5)
                behind = asyncio.create_task(other.infer(images(4), timeout=30))
            # gone's connection is closed, the batch with its image still running
            assert list((await behind).argmax(axis=1)) == [4]
        assert process.poll() is None, f"the engine died with {process.returncode}"


async def test_a_client_that_does_not_read_its_answers_is_not_read_either(
    engine: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    """A client with a large (sparse) block that sends one-image calls as fast as it can and never
    reads an answer (each 4 KB answer to a 20-byte call): once its answers fill the socket the
    engine stops reading its calls, and the client's sends block; the engine's memory stays bounded
    however long it goes on, and a worker is served meanwhile. The engine read such calls for ever,
    its unread answers piling up in its memory."""
    path, process = engine
    cells = 50_000
    fd = memfd(cells * GEOMETRY.image_bytes)
    sock = await connect(path)
    try:
        socket.send_fds(sock, [hello(cells=cells)], [fd])
    finally:
        os.close(fd)
    loop = asyncio.get_running_loop()
    (length,) = _READY.unpack(await loop.sock_recv(sock, _READY.size))
    assert length > 0
    rss = psutil.Process(process.pid).memory_info().rss
    calls = b"".join(request(i, i % cells) for i in range(1000))
    sent, blocked_since = 0, None
    async with asyncio.timeout(30):  # blocked for 2 s in a row, well before
        while blocked_since is None or loop.time() - blocked_since < 2:
            try:
                sent += sock.send(calls)
                blocked_since = None
            except BlockingIOError:
                blocked_since = blocked_since or loop.time()
                await asyncio.sleep(0.05)
    await still_serving(engine)
    grown = psutil.Process(process.pid).memory_info().rss - rss
    assert grown < 100 * 2**20, f"the engine grew by {grown / 2**20:.0f} MiB for {sent // 20:,} calls"
    sock.close()
