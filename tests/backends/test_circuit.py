from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from service.backends.base import Images
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

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        if self.broken:
            self.batches.append(len(images))
            raise BackendError("device lost")
        return await super().infer(images, timeout=timeout)


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


async def test_readiness_sends_the_trial_batch_itself() -> None:
    """With no traffic at all, an open circuit closes once the cooldown is over and the probe batch
    succeeds; while the backend is still broken the trial fails and readiness says why."""
    inner, clock = Flaky(), Clock()
    breaker = CircuitBreaker(inner, threshold=1, cooldown=5.0, clock=clock, probe=BATCH)
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    assert "circuit open" in (await breaker.ready() or "")
    assert len(inner.batches) == 1  # no trial during the cooldown
    clock.now += 5.0
    assert "the trial batch failed (device lost)" in (await breaker.ready() or "")
    assert breaker.state == "open"
    clock.now += 5.0
    inner.broken = False
    assert await breaker.ready() is None
    assert breaker.state == "closed"
    assert len(inner.batches) == 3  # the first failure and the two trials, nothing else


async def test_half_open_without_a_probe_counts_as_ready() -> None:
    inner, clock = Flaky(), Clock()
    breaker = CircuitBreaker(inner, threshold=1, cooldown=5.0, clock=clock)
    with pytest.raises(BackendError):
        await breaker.infer(BATCH)
    clock.now += 5.0
    assert await breaker.ready() is None  # the next batch is let through: the pod can take traffic


async def test_open_circuit_over_http(gateway_factory: Callable[..., Settings]) -> None:
    """Repeated backend failures: 500s, then fast 503s with a clear body and /readyz false; once
    the backend has recovered, /readyz alone (no request) turns ready again, and requests pass."""
    inner = Flaky()
    settings = gateway_factory(backend="fake", breaker_threshold=2, breaker_cooldown=0.3, readiness_interval=0.05)
    png = png_bytes(solid_image(7, 16))
    async with running_gateway(settings, inner) as client:

        async def post() -> tuple[int, str]:
            r = await client.post("/classify", content=png, headers={"content-type": "image/png"})
            return r.status_code, r.json().get("error", "")

        assert [await post() for _ in range(2)] == [(500, "backend_error")] * 2
        assert await post() == (503, "backend_unavailable")
        await asyncio.sleep(0.1)  # the next background check
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert "circuit open" in readyz.json()["checks"]["backend"]
        await asyncio.sleep(0.5)  # past the cooldown, the backend still broken: trials fail
        assert (await client.get("/readyz")).status_code == 503
        inner.broken = False
        async with asyncio.timeout(5):
            while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert await post() == (200, "")


class Counting(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.ready_calls = 0

    async def ready(self) -> str | None:
        self.ready_calls += 1
        return await super().ready()


async def test_readyz_answers_from_the_background_check(gateway_factory: Callable[..., Settings]) -> None:
    """200 anonymous /readyz calls cost the backend no call of their own: /readyz reads the latest
    background check (before, each cost Triton 2-3 RPCs); the check still follows the backend."""
    backend = Counting()
    settings = gateway_factory(backend="fake", readiness_interval=0.2)
    async with running_gateway(settings, backend) as client:
        started = asyncio.get_running_loop().time()
        for _ in range(200):
            assert (await client.get("/readyz")).status_code == 200
        elapsed = asyncio.get_running_loop().time() - started
        assert backend.ready_calls <= elapsed / 0.2 + 3
        backend.is_ready = False
        async with asyncio.timeout(3):
            while (await client.get("/readyz")).status_code != 503:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
