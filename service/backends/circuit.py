"""A circuit breaker around any backend.

After ``threshold`` consecutive failed batches the circuit opens: batches fail at once with 503 for
``cooldown`` seconds instead of piling onto a broken backend, and ``/readyz`` says so. Then one
batch is let through (half-open): success closes the circuit, failure opens it again. Deadlines
and full queues are the clients' business and do not count as backend failures.

Readiness does not wait for traffic: once the cooldown is over and the backend says it is ready,
``ready()`` sends the trial itself (``probe``, a one-image batch) and reports ready when it
succeeds. An open circuit used to stay open until a request came, and a pod out of rotation gets
none, so every replica stayed unready after any outage longer than the cooldown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from service.backends.base import Backend, Images
from service.errors import BackendUnavailable, DeadlineExceeded, QueueFull, public_text

logger = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        inner: Backend,
        *,
        threshold: int = 5,
        cooldown: float = 5.0,
        probe: np.ndarray | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.threshold = threshold
        self.cooldown = cooldown
        self._clock = clock
        self.probe = probe
        """A batch ``ready()`` may send as the trial (None: wait for real traffic)."""
        self.state: State = "closed"
        self.failures = 0
        self._opened_at = 0.0
        self._last_error = ""
        self._trial_running = False

    async def start(self) -> None:
        await self.inner.start()

    @property
    def detail(self) -> str | None:
        """The wrapped backend's description of what runs the model."""
        return self.inner.detail

    def liveness(self) -> str | None:
        """The wrapped backend's reason for the process not to be live."""
        return self.inner.liveness()

    def allocate_image(self) -> np.ndarray | None:
        """The wrapped backend's memory for an image."""
        return self.inner.allocate_image()

    def _open(self) -> None:
        if self.state != "open":
            logger.error(
                "circuit breaker: %s opened after %d consecutive failures (last: %s)",
                self.name,
                self.failures,
                self._last_error,
            )
        self.state = "open"
        self._opened_at = self._clock()

    def _refuse_if_open(self) -> None:
        if self.state == "closed":
            return
        remaining = self._opened_at + self.cooldown - self._clock()
        if self.state == "open" and remaining <= 0 and not self._trial_running:
            self.state = "half_open"
            return
        if self.state == "half_open" and not self._trial_running:
            return
        raise BackendUnavailable(
            f"the {self.name} backend failed {self.failures} batches in a row ({self._last_error}); "
            f"not sending it work for {max(remaining, 0):.1f} s"
        )

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        self._refuse_if_open()
        trial = self.state == "half_open"
        self._trial_running = trial
        try:
            scores = await self.inner.infer(images, timeout=timeout)
        except (DeadlineExceeded, QueueFull):
            raise
        except Exception as exc:
            self.failures += 1
            self._last_error = public_text(exc)[:200]
            if trial or self.failures >= self.threshold:
                self._open()
            raise
        finally:
            if trial:
                self._trial_running = False
        if self.state != "closed":
            logger.info("circuit breaker: %s closed again", self.name)
        self.state = "closed"
        self.failures = 0
        return scores

    async def ready(self) -> str | None:
        problem = await self.inner.ready()
        if problem is not None or self.state == "closed":
            return problem
        remaining = self._opened_at + self.cooldown - self._clock()
        if self.state == "open" and remaining > 0:
            return f"circuit open after {self.failures} consecutive failures: {self._last_error}"
        if self.probe is not None and not self._trial_running:
            try:
                await self.infer(self.probe, timeout=self.cooldown + 5.0)
            except Exception as exc:
                return f"circuit open: the trial batch failed ({public_text(exc)})"
        return None  # closed by the trial, or half-open: one batch will be let through

    async def aclose(self) -> None:
        await self.inner.aclose()
