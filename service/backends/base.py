"""The contract every backend meets."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Backend(Protocol):
    name: str
    """Short name used in logs, metrics and /readyz (``embedded``, ``triton``...)."""

    async def start(self) -> None:
        """Open connections or load the model; called once by the app's lifespan."""

    async def infer(self, batch: np.ndarray, *, timeout: float | None = None) -> np.ndarray:
        """``uint8 [N, H, W, 3]`` RGB images to ``float32 [N, classes]`` probabilities.

        ``timeout`` is the seconds left before the last request of the batch passes its deadline; a
        backend that can abandon a call should give up then. Raise ``service.errors.GatewayError``
        subclasses for failures the client should see."""
        ...

    async def ready(self) -> str | None:
        """None when ready to serve, otherwise why not."""
        ...

    async def aclose(self) -> None:
        """Release what ``start`` opened; called once at shutdown."""
