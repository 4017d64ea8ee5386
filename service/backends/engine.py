"""One process owns the GPU, the gateway's workers feed it: ``GATEWAY_TORCH_ENGINE=shared``.

With several uvicorn workers each holding its own model, each worker batches alone: on a 16-core
H100 host with one image per request, 16 workers formed batches of 2 and time-sliced the GPU
between 16 contexts (3,784 img/s against 10,172 with 32-image requests; docs/performance/gpu_figures.md). The
engine is the other design: the workers decode and batch as before, then hand their batches to one
engine process, whose own batcher merges them into the GPU's batches (what Triton's dynamic batcher
does for the microservice architecture, without leaving the host or copying images through gRPC).

The wire, per worker, over a Unix socket:

* the worker makes a block of image cells in an anonymous memory file (``memfd``) sealed against
  shrinking, and hands the engine its file descriptor with ``HELLO`` (``SCM_RIGHTS``) with the
  number of cells and the most images a call may carry; the engine maps it read-only and
  answers with its backend's description once its model is ready (it listens only then). Nothing
  has a name in ``/dev/shm``: the kernel frees the memory when the last of the two processes lets
  go of it, so a SIGKILLed worker leaves nothing behind, and a client can make the engine map only
  memory it already holds, never a file by name; the seal means it cannot truncate the block under
  the engine's reads (a SIGBUS in the engine);
* the block's cells: ``slots`` batch slots first (``max_inflight_batches`` of ``max_batch_size``
  cells each), then ``pool_images`` cells the worker's decoders write their images into
  (``service.backends.image_cells``: decoded straight into the memory the engine reads);
* a batch: ``(id, count, seconds left)`` and the ``count`` cells its images are in. Images decoded
  into cells are sent as they are, with no copy; any others (every cell was taken, a GPU
  decoder's images) are first copied into a free slot. The engine queues views of those
  cells (no copy) in its batcher and answers ``(id, status, count)`` with the ``float32 [count,
  classes]`` scores, or a status and an error message. The worker holds the batch's images (so
  their cells stay taken), or its slot, until the answer arrives (or the connection is gone).

The engine refuses (closes) a connection that breaks the wire: no HELLO within 5 s, a block that is
not a sealed memory file of the announced size, a cell or count out of range, more images in calls
at once than cells (each holds one in a worker). It reads no more calls from a worker that does
not read its answers.

Each connection is a generation in the worker: its calls fail together with 503 when it drops
(those waiting for a slot too), ids are the connection's own, and a call's ``timeout`` (its
requests' deadline) is honoured. A worker whose engine is gone is not ready (``/readyz``), and after
``engine_down_limit`` seconds not live (``/healthz``); ``gateway serve`` restarts a dead engine
(``service.backends.engine_supervisor``). The engine's batch sizes are
``gateway_engine_batch_size`` on every worker's /metrics (prometheus_client's multiprocess files).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from service.backends.base import BackendDefaults, Images, stack_into
from service.backends.image_cells import ImageCells
from service.errors import BackendError, BackendUnavailable, DeadlineExceeded, QueueFull

logger = logging.getLogger(__name__)

_MAGIC = b"GWE3"
_HELLO = struct.Struct("<4sIII")  # magic, cells, images per call at most, image bytes (+ the block's fd)
_REQUEST = struct.Struct("<QIf")  # id, count, seconds left (0: no deadline); then count uint32 cells
_CELLS = np.dtype("<u4")
_REPLY = struct.Struct("<QIII")  # id, status (_OK, _FAILED, _FULL, _UNAVAILABLE), count, payload bytes
_OK, _FAILED, _FULL, _UNAVAILABLE, _LATE = range(5)
_READY = struct.Struct("<I")  # length of the engine's JSON description
MAX_SLOTS, MAX_IMAGES_PER_CALL = 64, 1024  # the settings' bounds (max_inflight_batches, max_batch_size)
MAX_CELLS = 3 * MAX_SLOTS * MAX_IMAGES_PER_CALL  # the slots, and a pool of twice as many at most
HELLO_TIMEOUT = 5.0
"""Seconds a new connection has to say HELLO before the engine closes it."""
ACCEPT_RETRY = 1.0
"""Seconds the engine waits to accept again when it is out of file descriptors or memory."""
_ACCEPT_RETRY_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class Geometry:
    """The image shape both sides agree on."""

    image_size: int
    classes: int

    @property
    def image_bytes(self) -> int:
        return self.image_size * self.image_size * 3


class Refused(Exception):
    """A connection broke the wire; the engine closes it."""


def create_block(size: int) -> tuple[int, mmap.mmap]:
    """A worker's block: an anonymous memory file of ``size`` bytes sealed so that it can never
    change size (the engine may rely on it), mapped read-write; returns its fd and the mapping."""
    if not hasattr(os, "memfd_create"):
        raise RuntimeError("the shared engine needs Linux (memfd_create)")
    fd = os.memfd_create("gateway-engine", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def map_block(fd: int, size: int) -> mmap.mmap:
    """The engine's read-only view of a worker's block, if ``fd`` is one: a memory file sealed
    against shrinking, of at least ``size`` bytes. Anything else is refused: a file that could
    shrink would turn the engine's next read into a SIGBUS."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise Refused("the block is not a sealable memory file (memfd)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise Refused("the block is not sealed against shrinking")
    if os.fstat(fd).st_size < size:
        raise Refused(f"the block has {os.fstat(fd).st_size} bytes, its slots need {size}")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def receive_hello(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The HELLO's bytes and the file descriptors that came with them (the caller closes those)."""
    data, fds = b"", []
    try:
        while len(data) < _HELLO.size:
            try:
                chunk, more, flags, _ = socket.recv_fds(sock, _HELLO.size - len(data), 1, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                await _readable(sock)
                continue
            fds += more
            if flags & socket.MSG_CTRUNC:
                raise Refused("more than one file descriptor with the HELLO")
            if not chunk:
                raise asyncio.IncompleteReadError(data, _HELLO.size)
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return data, fds


@dataclass(frozen=True)
class _Hello:
    cells: int
    per_call: int
    block: mmap.mmap


def _check_hello(data: bytes, fds: list[int], geometry: Geometry) -> _Hello:
    """The worker's block, mapped, if its HELLO is one this engine serves; closes ``fds``."""
    try:
        magic, cells, per_call, image_bytes = _HELLO.unpack(data)
        if magic != _MAGIC:
            raise Refused(f"not an engine client of this version (magic {magic!r}, this engine's {_MAGIC!r})")
        if image_bytes != geometry.image_bytes:
            raise Refused(f"worker images are {image_bytes} bytes, the engine's {geometry.image_bytes}")
        if not (1 <= cells <= MAX_CELLS and 1 <= per_call <= MAX_IMAGES_PER_CALL):
            raise Refused(f"{cells} cells with up to {per_call} images a call is out of range")
        if len(fds) != 1:
            raise Refused(f"the HELLO came with {len(fds)} file descriptors, not 1")
        return _Hello(cells, per_call, map_block(fds[0], cells * image_bytes))
    finally:
        for fd in fds:
            os.close(fd)


# --- in each worker -------------------------------------------------------------------------------


class _Slots:
    """The block's free slots; a call waiting for one fails when its connection is lost."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._waiters: deque[tuple[int, asyncio.Future[int]]] = deque()

    async def acquire(self, generation: int) -> int:
        if self._free:
            return self._free.pop()
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((generation, waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot as it was cancelled
                self.release(waiter.result())
            raise

    def release(self, slot: int) -> None:
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)

    def fail_waiters(self, generation: int, error: Exception) -> None:
        kept: deque[tuple[int, asyncio.Future[int]]] = deque()
        for entry in self._waiters:
            if entry[0] != generation:
                kept.append(entry)
            elif not entry[1].done():
                entry[1].set_exception(error)
        self._waiters = kept


ANSWER_GRACE = 5.0
"""Seconds past a call's deadline after which an engine that has not answered it counts as stuck."""


@dataclass
class _Pending:
    """A call sent and not answered. Until the engine answers it holds the slot its copied images
    are in, and its images (holding those decoded into cells keeps the cells taken)."""

    future: asyncio.Future[np.ndarray]
    """Done when the call gave up (its deadline) before the answer."""
    slot: int | None
    images: Images
    owed_by: float
    """When the engine owes the answer by (monotonic: the call's deadline, or ``owed_within`` after
    it was sent when it has none, plus ``grace``)."""


class _Connection:
    """One connection to the engine: a generation of calls, with its own ids."""

    def __init__(self, generation: int, writer: asyncio.StreamWriter) -> None:
        self.generation = generation
        self.writer = writer
        self.pending: dict[int, _Pending] = {}
        """Calls sent and not answered."""
        self.next_id = 0
        self.lost: str | None = None

    def send(
        self,
        cells: list[int],
        slot: int | None,
        images: Images,
        timeout: float | None,
        owed_within: float,
        grace: float,
    ) -> asyncio.Future[np.ndarray]:
        """The call for ``images``, in ``cells`` (some copied into ``slot``): held until it is answered."""
        if self.lost is not None:
            raise BackendUnavailable(self.lost)
        self.next_id += 1
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        owed_by = time.monotonic() + (timeout if timeout else owed_within) + grace
        self.pending[self.next_id] = _Pending(future, slot, images, owed_by)
        header = _REQUEST.pack(self.next_id, len(cells), timeout or 0.0)
        self.writer.write(header + np.asarray(cells, _CELLS).tobytes())
        return future

    def overdue_since(self) -> float | None:
        """Since when the engine has owed an answer it has not given (None: it owes none yet). The
        engine answers every call by its deadline, late ones with 504: one still unanswered well
        after it means the engine is stuck, though its connection is up."""
        owed = min((call.owed_by for call in self.pending.values()), default=None)
        return owed if owed is not None and owed < time.monotonic() else None


class EngineClient(BackendDefaults):
    """The backend of a worker whose model runs in the shared engine."""

    name = "engine"

    def __init__(
        self,
        socket_path: str,
        geometry: Geometry,
        *,
        max_batch_size: int,
        slots: int,
        pool_images: int | None = None,
        down_limit: float = 120.0,
        answer_grace: float = ANSWER_GRACE,
    ) -> None:
        """``slots`` batches of ``max_batch_size`` images copied in at once; ``pool_images``: cells
        decoders write into (``allocate_image``; default twice the slots' images; the gateway's
        workers take ``max_queue_size`` more than the slots', every image queued or in flight). ``down_limit``:
        seconds without the engine (gone, or stuck) after which ``liveness`` reports it.
        ``answer_grace``: seconds past a call's deadline after which an engine that has not
        answered it counts as stuck."""
        self.socket_path = socket_path
        self.geometry = geometry
        self.max_batch_size = max_batch_size
        self.down_limit = down_limit
        self.answer_grace = answer_grace
        self.detail: str | None = None
        self.on_sent: Callable[[int, int], None] | None = None
        """Told each call's images sent as they were (in cells) and copied (``gateway_engine_images_total``)."""
        slotted = slots * max_batch_size
        pool = min(2 * slotted if pool_images is None else pool_images, MAX_CELLS - slotted)
        self._fd, self._block = create_block((slotted + pool) * geometry.image_bytes)
        size = geometry.image_size
        self._slots_view = np.ndarray((slots, max_batch_size, size, size, 3), np.uint8, buffer=self._block)
        self._slots = _Slots(slots)
        self._cells = ImageCells(self._block, (size, size, 3), slotted, pool)
        self._connection: _Connection | None = None
        self._generation = 0
        self._problem: str | None = "connecting to the engine"
        self._down_since: float | None = time.monotonic()
        self._connector: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    async def start(self) -> None:
        self._connector = asyncio.create_task(self._keep_connected(), name="engine-connection")
        with contextlib.suppress(TimeoutError):  # not ready until connected; /readyz says why
            await asyncio.wait_for(self._connected.wait(), 5)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect and hand the engine the block with HELLO (its fd rides along)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, self.socket_path)
            cells = len(self._block) // self.geometry.image_bytes
            hello = _HELLO.pack(_MAGIC, cells, self.max_batch_size, self.geometry.image_bytes)
            if socket.send_fds(sock, [hello], [self._fd]) != len(hello):  # a fresh socket's buffer is empty
                raise ConnectionError("the HELLO did not fit in the socket's buffer")
            return await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise

    async def _keep_connected(self) -> None:
        while True:
            try:
                reader, writer = await self._connect()
            except OSError as exc:
                problem = f"the shared engine is not reachable ({type(exc).__name__})"  # its socket's path: logged
                if problem != self._problem:
                    logger.warning("engine client: the engine at %s is not reachable: %s", self.socket_path, exc)
                self._problem = problem
                await asyncio.sleep(0.5)
                continue
            self._generation += 1
            connection = _Connection(self._generation, writer)
            pause = 0.2
            try:
                (length,) = _READY.unpack(await reader.readexactly(_READY.size))
                description: dict[str, Any] = json.loads(await reader.readexactly(length))
                if description.get("classes") != self.geometry.classes:
                    raise ValueError(f"the engine's model has {description.get('classes')} classes")
                self.detail = str(description.get("detail"))
                self._connection, self._problem, self._down_since = connection, None, None
                self._connected.set()
                await self._read(reader, connection)
                self._problem = "the engine closed the connection"
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                self._problem = f"lost the engine: {exc or type(exc).__name__}"
            except Exception as exc:
                self._problem = f"engine refused: {exc}"
                logger.warning("engine client: %s", self._problem)
                pause = 1.0
            finally:
                self._lose(connection, self._problem or "lost the engine")
                writer.close()
            await asyncio.sleep(pause)

    def _lose(self, connection: _Connection, problem: str) -> None:
        """Every call of ``connection``'s generation fails now with 503, and its slots are free."""
        self._connected.clear()
        if self._connection is connection:
            self._connection = None
        if self._down_since is None:
            self._down_since = time.monotonic()
        connection.lost = problem
        error = BackendUnavailable(problem)
        self._slots.fail_waiters(connection.generation, error)
        pending, connection.pending = connection.pending, {}
        for call in pending.values():
            if call.slot is not None:
                self._slots.release(call.slot)
            if not call.future.done():
                call.future.set_exception(error)

    async def _read(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        classes = self.geometry.classes
        while True:
            request_id, status, count, length = _REPLY.unpack(await reader.readexactly(_REPLY.size))
            if status == _OK and length != count * classes * 4:
                raise ConnectionError(f"the engine answered {length} bytes for {count} rows")
            payload = await reader.readexactly(length)
            call = connection.pending.pop(request_id, None)
            if call is None:
                raise ConnectionError(f"the engine answered call {request_id}, which it was not sent")
            future = call.future
            if call.slot is not None:
                self._slots.release(call.slot)  # the engine is done with it
            del call  # and with its images: their cells are free once the request lets go of them too
            if future.done():  # the call gave up (its deadline)
                continue
            if status == _OK:
                future.set_result(np.frombuffer(payload, np.float32).reshape(count, classes))
            else:
                future.set_exception(_failure(status, payload.decode(errors="replace")))

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        count = len(images)
        if count > self.max_batch_size:
            raise ValueError(f"a batch of {count} images is over max_batch_size ({self.max_batch_size})")
        connection = self._connection
        if connection is None:
            raise BackendUnavailable(self._problem or "not connected to the engine")
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the request deadline passed before the batch reached the engine")
        found = self._cells.indices(images)
        copied = [i for i, cell in enumerate(found) if cell is None]  # not decoded into cells
        try:
            async with asyncio.timeout(timeout):
                slot = None
                if copied:  # into a slot, the rest of the batch staying where it is
                    slot = await self._slots.acquire(connection.generation)
                    await self._copy(slot, [images[i] for i in copied])
                    for row, i in enumerate(copied):
                        found[i] = slot * self.max_batch_size + row
                cells = [cell for cell in found if cell is not None]
                if self.on_sent is not None:
                    self.on_sent(count - len(copied), len(copied))
                try:
                    answer = connection.send(cells, slot, images, timeout, self.down_limit, self.answer_grace)
                except BackendUnavailable:  # lost while copying
                    if slot is not None:
                        self._slots.release(slot)
                    raise
                # cancelled at the deadline: what it holds stays the engine's until it answers or the connection goes
                return await answer
        except TimeoutError:
            raise DeadlineExceeded(f"the engine did not answer within the request deadline ({timeout:.3f} s)") from None

    def allocate_image(self) -> np.ndarray | None:
        """A cell of the block to decode an image into (then its batch is sent with no copy), or
        None when every cell is taken. Any thread."""
        return self._cells.allocate()

    async def _copy(self, slot: int, images: Images) -> None:
        """The images into ``slot``, off the loop. A call that gives up meanwhile (deadline, shutdown)
        frees the slot only once the copy thread is done writing it."""
        copy = asyncio.get_running_loop().run_in_executor(
            None, stack_into, self._slots_view[slot, : len(images)], images
        )
        try:
            await asyncio.shield(copy)
        except BaseException:
            copy.add_done_callback(partial(self._copied, slot))
            raise

    def _copied(self, slot: int, copy: asyncio.Future[None]) -> None:
        if not copy.cancelled():
            copy.exception()  # retrieved: the call that gave up has its own error
        self._slots.release(slot)

    def _stuck(self) -> tuple[float, str] | None:
        """Since when, and why, a connected engine counts as stuck (None: it answers in time)."""
        connection = self._connection
        since = connection.overdue_since() if connection is not None else None
        if since is None:
            return None
        return since, f"the engine has not answered a call {self.answer_grace:g} s past its deadline (stuck?)"

    async def ready(self) -> str | None:
        stuck = self._stuck()
        return stuck[1] if stuck is not None else self._problem

    def liveness(self) -> str | None:
        """Why this worker is not live: without its engine, or with an engine that answers nothing,
        for longer than ``down_limit`` (then a restart of the pod may help; the gateway's own
        restarts of the engine have not, or a stuck engine has not exited for it to restart)."""
        stuck = self._stuck()
        down_since, problem = stuck if stuck is not None else (self._down_since, self._problem)
        if down_since is None or time.monotonic() - down_since <= self.down_limit:
            return None
        return f"no shared engine for {time.monotonic() - down_since:.0f} s: {problem}"

    async def aclose(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
        # The block is left to the last reference (a copy thread of a call that gave up may still
        # write into it: closing it here would unmap it under that thread).
        del self._slots_view, self._block
        os.close(self._fd)


def _failure(status: int, message: str) -> Exception:
    """The engine's failure as the worker reports it (full is 429, shutting down 503, late 504)."""
    if status == _FULL:
        return QueueFull(f"the shared engine's queue is full: {message}")
    if status == _UNAVAILABLE:
        return BackendUnavailable(f"engine: {message}")
    if status == _LATE:
        return DeadlineExceeded(f"engine: {message}")
    return BackendError(f"engine: {message}")
