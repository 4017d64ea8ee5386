"""The event loop every ``gateway`` command runs on: uvloop where it is installed, as for ``serve``.

uvicorn picks uvloop by itself (``loop="auto"``), so the HTTP gateway always ran on it; the queue
worker, the ingest client and the shared engine ran on asyncio's own loop, whose Python transports
cost the worker about a fifth of its event loop's time in socket writes and frame reads. uvloop
comes with ``uvicorn[standard]``; without it (Windows) asyncio's loop serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default) when uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the gateway's event loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
