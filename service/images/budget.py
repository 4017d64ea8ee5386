"""A budget of bytes shared by threads: decoder memory, reserved from the image header before decoding.

Bounding decoder memory per thread (``threads x max_image_bytes``) ties the number of decode threads
to memory: a few threads, each allowed one huge image. One budget for all of them lets many threads
decode ordinary photos (a megabyte each) at once, while a few huge images take turns.

Reservations are served first come, first served, so a large image is not starved by a stream of
small ones; a reservation larger than the whole budget is a programming error (images over
``max_image_bytes`` are refused before they get here, and the budget is at least that large).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service.errors import DeadlineExceeded


class ByteBudget:
    def __init__(self, capacity: int, on_wait: Callable[[], object] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a budget needs a positive capacity")
        self.capacity = capacity
        self._reserved = 0
        self._queue: deque[object] = deque()
        self._changed = threading.Condition()
        self._on_wait = on_wait
        """Called (in the waiting thread) for each reservation that cannot be served at once."""

    @property
    def reserved(self) -> int:
        return self._reserved

    @contextmanager
    def hold(self, size: int, deadline: float | None = None) -> Iterator[None]:
        """Reserve ``size`` bytes for the block, waiting in line while they are not free.

        ``deadline`` is on the ``time.monotonic`` clock (the event loop's); past it the wait ends
        with ``DeadlineExceeded``, without anything reserved."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes can never fit a budget of {self.capacity}")
        with self._changed:
            if self._queue or self._reserved + size > self.capacity:
                if self._on_wait is not None:
                    self._on_wait()
                self._wait_turn(size, deadline)
            self._reserved += size
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= size
                self._changed.notify_all()

    def _wait_turn(self, size: int, deadline: float | None) -> None:
        """Queue up and wait (the lock held by the caller) until first in line and ``size`` fits."""
        ticket = object()
        self._queue.append(ticket)
        try:
            while self._queue[0] is not ticket or self._reserved + size > self.capacity:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise DeadlineExceeded("the request deadline passed while waiting for decoder memory")
                self._changed.wait(timeout)
        finally:
            self._queue.remove(ticket)
            self._changed.notify_all()  # the next in line may fit now
