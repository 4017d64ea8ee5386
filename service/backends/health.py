"""The backend's readiness, checked in the background and read from memory.

``/readyz`` is polled by every kubelet and load balancer, often without a key: each call used to
cost Triton two or three RPCs. Now one task checks every ``interval`` seconds (and sends the
circuit breaker's trial batch when it is due, so a pod whose breaker opened during an outage
becomes ready again by itself, without waiting for a request that a not-ready pod never gets),
and ``/readyz`` answers from the latest result.
"""

from __future__ import annotations

import asyncio
import logging

from service.backends.base import Backend
from service.errors import public_text
from service.metrics import ModelMetrics

logger = logging.getLogger(__name__)


class BackendHealth:
    def __init__(self, backend: Backend, metrics: ModelMetrics, interval: float, name: str = "") -> None:
        self.backend = backend
        self.metrics = metrics
        self.name = name
        """The model version it serves, for the log."""
        self.interval = interval
        self.problem: str | None = "not checked yet"
        """None when the backend was ready at the last check, otherwise why not."""

    async def refresh(self) -> str | None:
        try:
            problem = await self.backend.ready()
        except Exception as exc:  # a check must never kill the loop
            logger.warning("readiness check failed: %s", exc)
            problem = f"readiness check failed: {public_text(exc)}"
        if problem != self.problem:
            logger.info(
                "%sbackend %s: %s", f"{self.name}: " if self.name else "", self.backend.name, problem or "ready"
            )
        self.problem = problem
        self.metrics.ready.set(0 if problem else 1)
        return problem

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)
