"""A budget of bytes shared by threads: decoder memory, reserved from the image header before decoding.

Bounding decoder memory per thread (``threads x max_image_bytes``) ties the number of decode threads
to memory: a few threads, each allowed one huge image. One budget for all of them lets many threads
decode ordinary photos (a megabyte each) at once, while a few huge images take turns.

Reservations are served first come, first served, so a large image is not starved by a stream of
small ones; a reservation larger than the whole budget is a programming error (images over
``max_image_bytes`` are refused before they get here, and the budget is at least that large).

With several models, each reserves through its ``share`` of the budget (``ByteBudget.share``): a
model is guaranteed ``capacity x weight / sum(weights)`` bytes, and a reservation that keeps its
model within that does not wait in line behind the other models' reservations; it waits only for
the bytes to be free (decodes give them back within milliseconds). Beyond its guarantee a model
borrows in line as before, so a flooded model's images queued for memory cannot stand between
another model's image and the budget. Passing the line stops while the reservation first in it has
waited ``HEAD_GRACE``: an image larger than its model's guarantee (with three models or more, the
default budget of two of the largest images leaves each less than one) is then served next rather
than starved by the other models' stream of small ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from service.errors import DeadlineExceeded

HEAD_GRACE = 0.1
"""Seconds the reservation first in line may be passed by reservations within their guarantee."""


class _Ticket:
    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since = time.monotonic()


class Budget(Protocol):
    """What decoding reserves memory from: a ``ByteBudget`` or one model's ``BudgetShare`` of it."""

    def hold(self, size: int, deadline: float | None = None) -> AbstractContextManager[None]: ...


class ByteBudget:
    def __init__(self, capacity: int, on_wait: Callable[[], object] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("a budget needs a positive capacity")
        self.capacity = capacity
        self._reserved = 0
        self._queue: deque[_Ticket] = deque()
        self._changed = threading.Condition()
        self._on_wait = on_wait
        """Called (in the waiting thread) for each reservation that cannot be served at once."""
        self._shares: list[BudgetShare] = []

    def share(self, weight: float) -> BudgetShare:
        """A model's way into the budget, with ``weight`` (see the module's text)."""
        share = BudgetShare(self, weight)
        with self._changed:
            self._shares.append(share)
            self._guarantee()
        return share

    def reweigh(self, share: BudgetShare, weight: float) -> None:
        """A new weight for ``share`` (a reloaded models file)."""
        with self._changed:
            share.weight = weight
            self._guarantee()
            self._changed.notify_all()

    def drop(self, share: BudgetShare) -> None:
        """Remove ``share`` (its model removed by a reload): the others' guarantees grow."""
        with self._changed:
            if share in self._shares:
                self._shares.remove(share)
            self._guarantee()
            self._changed.notify_all()

    def _guarantee(self) -> None:
        total = sum(share.weight for share in self._shares)
        for share in self._shares:
            share.guaranteed = int(self.capacity * share.weight / total)

    @property
    def reserved(self) -> int:
        return self._reserved

    @contextmanager
    def hold(self, size: int, deadline: float | None = None, share: BudgetShare | None = None) -> Iterator[None]:
        """Reserve ``size`` bytes for the block, waiting in line while they are not free (out of
        line within ``share``'s guarantee).

        ``deadline`` is on the ``time.monotonic`` clock (the event loop's); past it the wait ends
        with ``DeadlineExceeded``, without anything reserved."""
        if size > self.capacity:
            raise ValueError(f"{size} bytes can never fit a budget of {self.capacity}")
        with self._changed:
            if not self._may(size, share, None):
                if self._on_wait is not None:
                    self._on_wait()
                self._wait_turn(size, deadline, share)
            self._reserved += size
            if share is not None:
                share.reserved += size
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= size
                if share is not None:
                    share.reserved -= size
                self._changed.notify_all()

    def _may(self, size: int, share: BudgetShare | None, ticket: _Ticket | None) -> bool:
        """Whether a reservation (``ticket``: its place in line, if it has one) may be served now:
        it fits, and it is first in line, or within its share's guarantee while the first in line
        has waited less than ``HEAD_GRACE``."""
        if self._reserved + size > self.capacity:
            return False
        if not self._queue or self._queue[0] is ticket:
            return True
        within = share is not None and share.reserved + size <= share.guaranteed
        return within and time.monotonic() - self._queue[0].since < HEAD_GRACE

    def _wait_turn(self, size: int, deadline: float | None, share: BudgetShare | None) -> None:
        """Queue up and wait (the lock held by the caller) until ``size`` may be served."""
        ticket = _Ticket()
        self._queue.append(ticket)
        try:
            while not self._may(size, share, ticket):
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise DeadlineExceeded("the request deadline passed while waiting for decoder memory")
                self._changed.wait(timeout)
        finally:
            self._queue.remove(ticket)
            self._changed.notify_all()  # the next in line may fit now


class BudgetShare:
    """One model's part of a ``ByteBudget`` (``ByteBudget.share``)."""

    def __init__(self, budget: ByteBudget, weight: float) -> None:
        self.budget = budget
        self.weight = weight
        self.guaranteed = 0
        """Bytes it reserves without waiting in line (set by the budget as shares are added)."""
        self.reserved = 0

    def hold(self, size: int, deadline: float | None = None) -> AbstractContextManager[None]:
        return self.budget.hold(size, deadline, self)
