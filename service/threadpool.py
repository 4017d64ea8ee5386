"""A thread pool that hands results straight to asyncio futures.

``loop.run_in_executor`` costs the event loop a ``concurrent.futures.Future``, a work item, the
executor's locks and a chained asyncio future per call; on the serving path (one call per image)
that bookkeeping cost more event-loop time than the rest of the image's path in the loop. Here a
call is one ``SimpleQueue.put``, and a worker thread completes the asyncio future with a single
``call_soon_threadsafe``. Work is plain synchronous functions (OpenCV, ONNX Runtime) that release
the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (cancelled, deadline): drop the outcome
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ThreadPool:
    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            loop, future, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as exc:
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, future, result, error)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` in a worker thread; the future completes on the calling loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def shutdown(self) -> None:
        """Finish the queued work, then stop the threads."""
        for _ in self._threads:
            self._jobs.put(_STOP)
        for thread in self._threads:
            thread.join()
