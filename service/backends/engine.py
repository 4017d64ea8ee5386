"""One process owns the GPU, the gateway's workers feed it: ``GATEWAY_TORCH_ENGINE=shared``.

With several uvicorn workers each holding its own model, each worker batches alone: on a 16-core
H100 host with one image per request, 16 workers formed batches of 2 and time-sliced the GPU
between 16 contexts (3,784 img/s against 10,172 with 32-image requests; docs/performance.md). The
engine is the other design: the workers decode and batch as before, then hand their batches to one
engine process, whose own batcher merges them into the GPU's batches (what Triton's dynamic batcher
does for the microservice architecture, without leaving the host or copying images through gRPC).

The wire, per worker, over a Unix socket:

* the worker creates a shared-memory block of ``slots`` batch slots (``max_inflight_batches`` of
  ``max_batch_size`` images each) and says its name (``HELLO``); the engine maps it and answers
  with its backend's description once its model is ready (it listens only then);
* a batch: the worker copies its images into a free slot and sends ``(id, slot, count)``; the engine
  queues views of those images (no copy) in its batcher and answers ``(id, status, count)`` with the
  ``float32 [count, classes]`` scores, or status 1 and an error message. The slot is the worker's
  again once the answer arrives.

A worker whose engine is gone is not ready (``/readyz``) and its batches fail with 503 until it
reconnects; the engine's batch sizes are ``gateway_engine_batch_size`` on every worker's /metrics
(prometheus_client's multiprocess files).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from service.backends.base import Images, stack_into
from service.batcher import DynamicBatcher
from service.errors import BackendError, BackendUnavailable, QueueFull

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<IIII")  # name length, slots, images per slot, image bytes
_REQUEST = struct.Struct("<QII")  # id, slot, count
_REPLY = struct.Struct("<QIII")  # id, status (_OK, _FAILED, _FULL, _UNAVAILABLE), count, payload bytes
_OK, _FAILED, _FULL, _UNAVAILABLE = range(4)
_READY = struct.Struct("<I")  # length of the engine's JSON description


@dataclass(frozen=True)
class Geometry:
    """The image shape both sides agree on."""

    image_size: int
    classes: int

    @property
    def image_bytes(self) -> int:
        return self.image_size * self.image_size * 3


def _shared_memory(name: str) -> shared_memory.SharedMemory:
    """Attach to the worker's block without letting this process's resource tracker unlink it at
    exit (the worker owns it)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # Python 3.13+
    except TypeError:
        block = shared_memory.SharedMemory(name=name)
        with contextlib.suppress(Exception):
            from multiprocessing import resource_tracker

            resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
        return block


# --- the engine process ---------------------------------------------------------------------------


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
        self._writers: set[asyncio.StreamWriter] = set()

    def observe(self, size: int) -> None:
        self.batch_size.observe(size)

    def close(self) -> None:
        """Close every worker's connection (they see the engine gone, and are not ready)."""
        for writer in self._writers:
            writer.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        block: shared_memory.SharedMemory | None = None
        images: np.ndarray | None = None
        tasks: set[asyncio.Task[None]] = set()
        self._writers.add(writer)
        try:
            name_length, slots, per_slot, image_bytes = _HELLO.unpack(await reader.readexactly(_HELLO.size))
            name = (await reader.readexactly(name_length)).decode()
            if image_bytes != self.geometry.image_bytes:
                raise ValueError(f"worker images are {image_bytes} bytes, the engine's {self.geometry.image_bytes}")
            block = _shared_memory(name)
            size = self.geometry.image_size
            images = np.ndarray((slots, per_slot, size, size, 3), np.uint8, buffer=block.buf)
            ready = json.dumps({"detail": self.detail, "classes": self.geometry.classes}).encode()
            writer.write(_READY.pack(len(ready)) + ready)
            while True:
                request_id, slot, count = _REQUEST.unpack(await reader.readexactly(_REQUEST.size))
                task = asyncio.create_task(self._answer(writer, request_id, images[slot, :count]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away
        except Exception:
            logger.exception("engine: a worker's connection failed")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del images  # the views must go before the block closes
            self._writers.discard(writer)
            writer.close()
            if block is not None:
                with contextlib.suppress(BufferError):
                    block.close()

    async def _answer(self, writer: asyncio.StreamWriter, request_id: int, images: np.ndarray) -> None:
        try:
            rows = await self.batcher.submit(list(images))
            scores = np.ascontiguousarray(np.stack(rows), dtype=np.float32)
            payload = scores.tobytes()
            writer.write(_REPLY.pack(request_id, _OK, len(rows), len(payload)) + payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker raises the same kind: full is 429, shutting down 503
            status = (
                _FULL
                if isinstance(exc, QueueFull)
                else _UNAVAILABLE
                if isinstance(exc, BackendUnavailable)
                else _FAILED
            )
            message = (str(exc) if status != _FAILED else f"{type(exc).__name__}: {exc}").encode()
            writer.write(_REPLY.pack(request_id, status, 0, len(message)) + message)


async def run_engine(socket_path: str, stop: asyncio.Event) -> None:
    """The engine process's life: load the backend, then serve the workers until ``stop``."""
    from service.models.profiles import get_profile
    from service.pipeline import build_backend
    from service.settings import Settings

    settings = Settings(torch_engine="per-worker", engine_socket=None)  # type: ignore[call-arg]
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
    )
    detail = f"engine shared by the workers: {getattr(backend, 'detail', None) or backend.name}"
    engine = EngineServer(batcher, Geometry(profile.image_size, len(profile.labels)), detail)
    batcher.start()
    server = await asyncio.start_unix_server(engine.handle, path=socket_path)
    logger.info("engine: %s, serving %s", detail, socket_path)
    try:
        await stop.wait()
    finally:
        server.close()
        engine.close()
        await batcher.aclose()
        await backend.aclose()


# --- in each worker -------------------------------------------------------------------------------


class EngineClient:
    """The backend of a worker whose model runs in the shared engine."""

    name = "engine"

    def __init__(self, socket_path: str, geometry: Geometry, *, max_batch_size: int, slots: int) -> None:
        self.socket_path = socket_path
        self.geometry = geometry
        self.max_batch_size = max_batch_size
        self.detail: str | None = None
        self._block = shared_memory.SharedMemory(create=True, size=slots * max_batch_size * geometry.image_bytes)
        size = geometry.image_size
        self._slots_view = np.ndarray((slots, max_batch_size, size, size, 3), np.uint8, buffer=self._block.buf)
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(slots):
            self._free.put_nowait(slot)
        self._pending: dict[int, asyncio.Future[np.ndarray]] = {}
        self._next_id = 0
        self._writer: asyncio.StreamWriter | None = None
        self._problem: str | None = "connecting to the engine"
        self._connector: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    async def start(self) -> None:
        self._connector = asyncio.create_task(self._keep_connected(), name="engine-connection")
        with contextlib.suppress(TimeoutError):  # not ready until connected; /readyz says why
            await asyncio.wait_for(self._connected.wait(), 5)

    async def _keep_connected(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                self._problem = f"engine at {self.socket_path} not reachable: {exc}"
                await asyncio.sleep(0.5)
                continue
            try:
                name = self._block.name.encode()
                slots, per_slot = self._slots_view.shape[:2]
                writer.write(_HELLO.pack(len(name), slots, per_slot, self.geometry.image_bytes) + name)
                (length,) = _READY.unpack(await reader.readexactly(_READY.size))
                description: dict[str, Any] = json.loads(await reader.readexactly(length))
                if description.get("classes") != self.geometry.classes:
                    raise ValueError(f"the engine's model has {description.get('classes')} classes")
                self.detail = str(description.get("detail"))
                self._writer, self._problem = writer, None
                self._connected.set()
                await self._read(reader)
                self._problem = "the engine closed the connection"
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                self._problem = f"lost the engine: {exc or type(exc).__name__}"
            except Exception as exc:
                self._problem = f"engine refused: {exc}"
                logger.warning("engine client: %s", self._problem)
                await asyncio.sleep(1)
            finally:
                self._connected.clear()
                self._writer = None
                writer.close()
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(BackendUnavailable(self._problem or "lost the engine"))
                self._pending.clear()
            await asyncio.sleep(0.2)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            request_id, status, count, length = _REPLY.unpack(await reader.readexactly(_REPLY.size))
            payload = await reader.readexactly(length)
            future = self._pending.pop(request_id, None)
            if future is None or future.done():
                continue
            message = payload.decode(errors="replace") if status != _OK else ""
            if status == _OK:
                future.set_result(np.frombuffer(payload, np.float32).reshape(count, self.geometry.classes))
            elif status == _FULL:
                future.set_exception(QueueFull(f"the shared engine's queue is full: {message}"))
            elif status == _UNAVAILABLE:
                future.set_exception(BackendUnavailable(f"engine: {message}"))
            else:
                future.set_exception(BackendError(f"engine: {message}"))

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        count = len(images)
        if count > self.max_batch_size:
            raise ValueError(f"a batch of {count} images is over max_batch_size ({self.max_batch_size})")
        writer = self._writer
        if writer is None:
            raise BackendUnavailable(self._problem or "not connected to the engine")
        slot = await self._free.get()
        try:
            view = self._slots_view[slot, :count]
            await asyncio.to_thread(stack_into, view, images)
            request_id = self._next_id = self._next_id + 1
            future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
            self._pending[request_id] = future
            writer.write(_REQUEST.pack(request_id, slot, count))
            return await future
        finally:
            self._free.put_nowait(slot)

    async def ready(self) -> str | None:
        return self._problem

    async def aclose(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
        del self._slots_view
        self._block.close()
        with contextlib.suppress(FileNotFoundError):
            self._block.unlink()
