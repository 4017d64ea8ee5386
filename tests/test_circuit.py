from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from service.backends.circuit import CircuitBreaker
from service.backends.fake import FakeBackend
from service.errors import BackendError, BackendUnavailable, DeadlineExceeded
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

BATCH = np.zeros((1, 8, 8, 3), np.uint8)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Flaky(FakeBackend):
    """Fails while ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    async def infer(self, batch: np.ndarray, *, timeout: float | None = None) -> np.ndarray:
        if self.broken:
            self.batches.append(int(batch.shape[0]))
            raise BackendError("device lost")
        return await super().infer(batch, timeout=timeout)


async def test_opens_after_consecutive_failures_then_half_opens_and_closes() -> None:
    inner, clock = Flaky(), Clock()
    breaker = CircuitBreaker(inner, threshold=3, cooldown=5.0, clock=clock)
    for _ in range(3):
        with pytest.raises(BackendError):
            await breaker.infer(BATCH)
    assert breaker.state == "open"
    with pytest.raises(BackendUnavailable, match="failed 3 batches in a row"):
        await breaker.infer(BATCH)
    assert len(inner.batches) == 3  # the open circuit did not call the backend
    assert "circuit open" in (await breaker.ready() or "")

    clock.now += 5.0  # cooldown over: one trial, which fails -> open again
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    assert breaker.state == "open"
    with pytest.raises(BackendUnavailable):
        await breaker.infer(BATCH)

    clock.now += 5.0
    inner.broken = False  # the backend recovered: the trial succeeds and closes the circuit
    assert (await breaker.infer(BATCH)).shape == (1, 1000)
    assert breaker.state == "closed"
    assert await breaker.ready() is None


async def test_a_success_resets_the_count_and_client_errors_do_not_count() -> None:
    inner = Flaky()
    breaker = CircuitBreaker(inner, threshold=2, cooldown=5.0)
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    inner.broken = False
    await breaker.infer(BATCH)
    inner.broken = True
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    assert breaker.state == "closed"  # 1 failure, then success, then 1 failure: never 2 in a row

    inner.fail_next = DeadlineExceeded("client deadline")
    inner.broken = False
    with pytest.raises(DeadlineExceeded):
        await breaker.infer(BATCH)
    assert breaker.failures == 1


async def test_only_one_trial_batch_while_half_open() -> None:
    inner, clock = Flaky(), Clock()
    breaker = CircuitBreaker(inner, threshold=1, cooldown=1.0, clock=clock)
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    clock.now += 1.0
    inner.broken = False
    inner.gate = asyncio.Event()
    trial = asyncio.create_task(breaker.infer(BATCH))
    await inner.wait_for_batches(2)  # the failed batch, then the trial, now held at the gate
    with pytest.raises(BackendUnavailable):  # a second batch during the trial is refused
        await breaker.infer(BATCH)
    inner.gate.set()
    await trial
    assert breaker.state == "closed"


async def test_open_circuit_over_http(gateway_factory: Callable[..., Settings]) -> None:
    """Repeated backend failures: 500s, then fast 503s with a clear body and /readyz false; after
    the cooldown and a successful trial, 200 and ready again."""
    inner = Flaky()
    settings = gateway_factory(backend="fake", breaker_threshold=2, breaker_cooldown=0.3)
    png = png_bytes(solid_image(7, 16))
    async with running_gateway(settings, inner) as client:

        async def post() -> tuple[int, str]:
            r = await client.post("/classify", content=png, headers={"content-type": "image/png"})
            return r.status_code, r.json().get("error", "")

        assert [await post() for _ in range(2)] == [(500, "backend_error")] * 2
        assert await post() == (503, "backend_unavailable")
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert "circuit open" in readyz.json()["checks"]["backend"]
        inner.broken = False
        await asyncio.sleep(0.35)
        assert await post() == (200, "")
        assert (await client.get("/readyz")).status_code == 200
