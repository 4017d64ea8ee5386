"""The engine process's root: one backend and one batcher serving every worker's batches.

``gateway engine`` (started and supervised by ``gateway serve`` with ``GATEWAY_TORCH_ENGINE=shared``)
runs :func:`run_engine`; the wire it speaks and the workers' client are in ``service.backends.engine``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from functools import partial

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from service.backends.engine import (
    _ACCEPT_RETRY_ERRORS,
    _CELLS,
    _FAILED,
    _FULL,
    _LATE,
    _OK,
    _READY,
    _REPLY,
    _REQUEST,
    _UNAVAILABLE,
    ACCEPT_RETRY,
    HELLO_TIMEOUT,
    Geometry,
    Refused,
    _check_hello,
    _Hello,
    receive_hello,
)
from service.backends.factory import build_backend
from service.batching.batcher import DynamicBatcher
from service.errors import BackendUnavailable, DeadlineExceeded, GatewayError, QueueFull, public_text
from service.host.stages import PauseWatch, stage_histogram, stage_observer
from service.models.profiles import get_profile
from service.settings import Settings

logger = logging.getLogger(__name__)


class EngineServer:
    """Serves the workers through one batcher over the engine's backend (in the engine process)."""

    def __init__(
        self,
        batcher: DynamicBatcher,
        geometry: Geometry,
        detail: str,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        """``registry``: where the batch-size histogram registers (in multiprocess mode its values
        go to the shared files whatever the registry)."""
        self.batcher = batcher
        self.geometry = geometry
        self.detail = detail
        self.batch_size = Histogram(
            "gateway_engine_batch_size",
            "Images per batch the shared GPU engine ran (GATEWAY_TORCH_ENGINE=shared), merged across workers.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=registry,
        )
        self.observe_stage = stage_observer(
            stage_histogram(registry), renamed={"batch_wait": "engine_wait", "backend": "gpu", "wake": "engine_wake"}
        )
        """The engine's stages (``service.host.stages``): its batcher's wait and the backend's call."""
        self._connections: set[asyncio.Task[None]] = set()

    def observe(self, size: int) -> None:
        self.batch_size.observe(size)

    @staticmethod
    def listen(path: str) -> socket.socket:
        """The engine's Unix socket at ``path`` (a dead engine's socket there is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(64)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        return listener

    async def serve(self, listener: socket.socket) -> None:
        """Accept workers on ``listener`` until cancelled; then close every worker's connection
        (they see the engine gone, and are not ready)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(listener)
                except OSError as exc:
                    if exc.errno not in _ACCEPT_RETRY_ERRORS:
                        raise
                    # out of file descriptors or memory: the connection waits in the backlog until
                    # others close (what asyncio's own servers do); the listener must stay open
                    logger.warning("engine: cannot accept a connection (%s); again in %.0f s", exc, ACCEPT_RETRY)
                    await asyncio.sleep(ACCEPT_RETRY)
                    continue
                task = asyncio.create_task(self.handle(conn))
                self._connections.add(task)
                task.add_done_callback(self._connections.discard)
        finally:
            listener.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def handle(self, conn: socket.socket) -> None:
        """One worker's connection, from its HELLO until it closes or breaks the wire."""
        conn.setblocking(False)
        hello: _Hello | None = None
        images: np.ndarray | None = None
        writer: asyncio.StreamWriter | None = None
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                data, fds = await receive_hello(conn)
            hello = _check_hello(data, fds, self.geometry)
            size = self.geometry.image_size
            images = np.ndarray((hello.cells, size, size, 3), np.uint8, buffer=hello.block)
            reader, writer = await asyncio.open_unix_connection(sock=conn)
            ready = json.dumps({"detail": self.detail, "classes": self.geometry.classes}).encode()
            writer.write(_READY.pack(len(ready)) + ready)
            in_flight = 0  # images of this connection's calls not answered yet

            def answered(count: int) -> None:  # before the answer is sent: the worker may reuse the cells then
                nonlocal in_flight
                in_flight -= count

            while True:
                await writer.drain()  # a worker that does not read its answers is not read either
                request_id, count, seconds = _REQUEST.unpack(await reader.readexactly(_REQUEST.size))
                if not 1 <= count <= hello.per_call:
                    raise Refused(f"a call of {count} images (at most {hello.per_call})")
                cells = np.frombuffer(await reader.readexactly(count * _CELLS.itemsize), _CELLS)
                if cells.max() >= hello.cells:
                    raise Refused(f"cell {cells.max()} is outside the block of {hello.cells}")
                if in_flight + count > hello.cells:  # a worker's images in flight each hold a cell
                    raise Refused(f"{in_flight + count} images in calls at once, more than the {hello.cells} cells")
                in_flight += count
                batch = [images[cell] for cell in cells.tolist()]
                task = asyncio.create_task(self._answer(writer, request_id, batch, seconds, partial(answered, count)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except Refused as exc:
            logger.warning("engine: refused a connection: %s", exc)
        except TimeoutError:
            logger.warning("engine: refused a connection: no HELLO within %.0f s", HELLO_TIMEOUT)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away
        except Exception:
            logger.exception("engine: a worker's connection failed")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if writer is not None:
                writer.close()
            else:
                conn.close()
            # The block is not closed here: a batch still running may hold views of its images (numpy
            # keeps a reference to the mmap, not a buffer export, so close() would unmap it under
            # them: a SIGSEGV). The views keep the mmap alive; the last one to go unmaps it.
            del images, hello

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        request_id: int,
        images: list[np.ndarray],
        seconds: float,
        answered: Callable[[], None],
    ) -> None:
        reply = await self._reply(request_id, images, seconds)
        del images  # not held while the reply waits for the worker to read it
        answered()
        writer.write(reply)
        await writer.drain()  # a worker that does not read holds this call, and then is not read either

    async def _reply(self, request_id: int, images: list[np.ndarray], seconds: float) -> bytes:
        try:
            deadline = asyncio.get_running_loop().time() + seconds if seconds > 0 else None
            rows = await self.batcher.submit(images, deadline=deadline)
            scores = np.ascontiguousarray(np.stack(rows), dtype=np.float32)
            payload = scores.tobytes()
            return _REPLY.pack(request_id, _OK, len(rows), len(payload)) + payload
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker raises the same kind: full is 429, shutting down 503
            status = (
                _FULL
                if isinstance(exc, QueueFull)
                else _UNAVAILABLE
                if isinstance(exc, BackendUnavailable)
                else _LATE
                if isinstance(exc, DeadlineExceeded)
                else _FAILED
            )
            if not isinstance(exc, GatewayError):
                logger.warning("engine: a call failed: %s: %s", type(exc).__name__, exc)
            message = public_text(exc).encode()  # the workers answer it: no path, address or region in it
            return _REPLY.pack(request_id, status, 0, len(message)) + message


async def run_engine(
    settings: Settings, socket_path: str, stop: asyncio.Event, on_ready: Callable[[], None] | None = None
) -> None:
    """The engine process's life (``gateway engine``'s settings: its flags over the environment
    serve hands it): load the backend, then serve the workers until ``stop``; ``on_ready`` is
    called once it listens."""
    settings = settings.model_copy(
        update={
            "torch_engine": "per-worker",
            "engine_socket": None,
            "max_inflight_batches": settings.engine_inflight_batches,
        }
    )
    profile = get_profile(settings.model)
    backend = await build_backend(settings, profile)
    await backend.start()
    problem = await backend.ready()
    if problem:
        raise SystemExit(f"engine: the backend is not ready: {problem}")
    batcher = DynamicBatcher(
        backend.infer,
        max_batch_size=settings.max_batch_size,
        max_delay=settings.max_delay,
        max_queue_size=settings.max_queue_size * max(1, settings.workers),
        max_inflight_batches=settings.max_inflight_batches,
        on_batch=lambda report: engine.observe(report.size),  # bound below, before the first batch
        backend_name=backend.name,
        policy=settings.batch_policy,
        on_stage=lambda stage, seconds: engine.observe_stage(stage, seconds),
    )
    detail = f"engine shared by the workers: {backend.detail or backend.name}"
    engine = EngineServer(batcher, Geometry(profile.height, profile.outputs), detail)
    batcher.start()
    pauses = PauseWatch(engine.observe_stage)
    pauses.start()
    serving = asyncio.create_task(engine.serve(engine.listen(socket_path)), name="engine-accept")
    logger.info("engine: %s, serving", detail)
    logger.debug("engine: serving %s", socket_path)
    if on_ready is not None:
        on_ready()
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # no longer listening: exit, so that the supervisor starts another engine
            raise SystemExit(f"engine: stopped accepting workers: {serving.exception()!r}")
    finally:
        pauses.stop()
        stopping.cancel()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await batcher.aclose()
        await backend.aclose()
