"""``ModelStreamInfer``: a bidirectional stream of inference requests, each answered as it finishes.

What one stream holds at once is bounded like one call: at most ``IN_FLIGHT`` requests, and at most
``max_bytes`` (``GATEWAY_MAX_BODY_BYTES``, one call's largest message) of them, counted from when a
request is read until its answer has been handed to the transport. A client that sends faster than
it reads answers stops being read (HTTP/2 flow control then stops it), rather than growing the
server's memory. Each request takes its API key's concurrency slot while it is worked on, as a
call does. Once the gateway is shutting down, a new request is answered UNAVAILABLE and the stream
ends when the answers in flight are sent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from service.errors import BackendUnavailable, GatewayError
from service.grpc.calls import Caller, Calls
from service.grpc.status import code_of

logger = logging.getLogger(__name__)

IN_FLIGHT = 64
"""Requests of one stream being answered at once."""
ECHOED = 256
"""Longest model name, version or id a failed request's answer echoes (a longer one is cut)."""


class Window:
    """Requests a stream holds, by count and bytes; ``enter`` waits for room."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self._held, self._bytes = 0, 0
        self._room = asyncio.Condition()

    async def enter(self, size: int) -> None:
        async with self._room:
            # one request alone always fits (the transport bounds a message to ``size``)
            await self._room.wait_for(
                lambda: self._held < self.count and (self._held == 0 or self._bytes + size <= self.size)
            )
            self._held += 1
            self._bytes += size

    async def leave(self, size: int) -> None:
        async with self._room:
            self._held -= 1
            self._bytes -= size
            self._room.notify_all()


def _failed(request: Any, code: grpc.StatusCode, message: str) -> Any:
    return service_pb2.ModelStreamInferResponse(
        error_message=f"{code.name}: {message}",
        infer_response=service_pb2.ModelInferResponse(
            model_name=getattr(request, "model_name", "")[:ECHOED],
            model_version=getattr(request, "model_version", "")[:ECHOED],
            id=getattr(request, "id", "")[:ECHOED],
        ),
    )


async def answer_stream(
    requests: Any,
    caller: Caller,
    calls: Calls,
    infer: Callable[[Any, Caller], Awaitable[Any]],
    closing: Callable[[], bool],
    max_bytes: int,
) -> AsyncGenerator[Any, None]:
    """The answers to ``requests`` (a stream's request iterator), each by ``infer``."""
    answers: asyncio.Queue[tuple[Any, int] | None] = asyncio.Queue()
    window = Window(IN_FLIGHT, max_bytes)
    tasks: set[asyncio.Task[None]] = set()
    metrics = calls.gateway.metrics

    async def answer(request: Any, size: int) -> None:
        start, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            with calls.slot(caller):
                response = service_pb2.ModelStreamInferResponse(infer_response=await infer(request, caller))
        except GatewayError as exc:
            code = code_of(exc)
            metrics.rejections.labels(exc.error).inc()
            response = _failed(request, code, exc.detail)
        except Exception:
            code = grpc.StatusCode.INTERNAL
            logger.exception("grpc: a streamed inference failed")
            response = _failed(request, code, "the gateway failed to answer this request (its log says why)")
        calls.record("ModelStreamInfer.request", code, time.perf_counter() - start)
        answers.put_nowait((response, size))

    async def read() -> None:
        async for request in requests:
            size = request.ByteSize() if hasattr(request, "ByteSize") else 0
            await window.enter(size)
            if closing():
                refusal = BackendUnavailable("the gateway is shutting down: send the rest to another replica")
                calls.record("ModelStreamInfer.request", code_of(refusal), 0.0)
                answers.put_nowait((_failed(request, code_of(refusal), refusal.detail), size))
                break
            task = asyncio.create_task(answer(request, size))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks))
        answers.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (item := await answers.get()) is not None:
            response, size = item
            yield response
            await window.leave(size)  # handed to the transport: room for the next request
        await reader  # its errors (a broken stream) end the call
    finally:
        for task in (reader, *tasks):
            task.cancel()  # the client left: their images leave the batcher
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(reader, *tasks, return_exceptions=True)
