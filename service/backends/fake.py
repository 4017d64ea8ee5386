"""A deterministic stand-in backend, for tests and for measuring the gateway without a model.

Each image's score row is one-hot on the class given by its first pixel's red value, so a test can
check that every caller got its own image's answer. A test can hold batches at a gate, make the
next batch fail, or make it return the wrong number of rows.
"""

from __future__ import annotations

import asyncio

import numpy as np

from service.backends.base import BackendDefaults, Images
from service.errors import BackendError


class FakeBackend(BackendDefaults):
    name = "fake"

    def __init__(self, *, classes: int = 1000, delay: float = 0.0) -> None:
        self.classes = classes
        self.delay = delay
        self.batches: list[int] = []
        """Size of every batch received, in order."""
        self.gate: asyncio.Event | None = None
        """When set to an unset Event, batches wait for it before answering."""
        self.entered = asyncio.Condition()
        self.fail_next: Exception | None = None
        """The next batch to enter raises this."""
        self.drop_one_row = False
        self.is_ready = True
        self.started = False
        self.closed = False

    async def start(self) -> None:
        self.started = True

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        failure, self.fail_next = self.fail_next, None  # the batch entering now takes the failure
        async with self.entered:
            self.batches.append(len(images))
            self.entered.notify_all()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if failure is not None:
            raise failure
        if not self.is_ready:
            raise BackendError("fake backend is down")
        scores = np.zeros((len(images), self.classes), np.float32)
        scores[np.arange(len(images)), [int(image[0, 0, 0]) % self.classes for image in images]] = 1.0
        return scores[:-1] if self.drop_one_row else scores

    async def wait_for_batches(self, count: int) -> None:
        """Return once ``count`` batches have entered ``infer``."""
        async with self.entered:
            await self.entered.wait_for(lambda: len(self.batches) >= count)

    async def ready(self) -> str | None:
        return None if self.is_ready else "fake backend marked not ready"

    async def aclose(self) -> None:
        self.closed = True
