"""The adaptive batching policy, and what a batch of n images costs the backend, learned online:
``seconds(n) = a * n + b``.

Least squares over a sliding window of the most recent batches (sizes and backend seconds), updated
once per finished batch from the batcher's report (no polling, no timer). ``b`` is the fixed cost of
a call (framework, network, kernel launches), ``a`` the cost of one more image; the adaptive batcher
reads them to decide how long a batch is worth waiting for, and whether a request's deadline can
still be met behind the queue ahead of it.

While the window holds batches of one size only (at start, or under a sustained overload where
every batch is full) the slope cannot be told from the intercept. The model then keeps the slope it
learned last and moves the intercept to fit the new times; with no slope learned yet, it takes the
time as all per-call cost (flat). Both err towards predicting less time for more images than a
proportional guess would, so admission refuses no request on a guess, and the batch sizes the
policy then picks give the window the variety it needs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

HEADROOM = 1.25
"""The adaptive policy sizes batches for arrivals this much faster than measured, so the backend
runs at most ~80 % busy and a burst does not start a queue at once."""
RATE_TIME_CONSTANT = 1.0
"""Seconds over which the arrival-rate estimate forgets (exponentially weighted)."""


@dataclass(frozen=True)
class Fit:
    a: float
    """Seconds per image."""
    b: float
    """Seconds per call."""

    def seconds(self, n: int) -> float:
        return self.a * n + self.b


class BatchLatencyModel:
    def __init__(self, window: int = 64) -> None:
        if window < 2:
            raise ValueError("the window must hold at least two batches")
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: Fit | None = None
        self.last_error: float | None = None
        """The latest batch's actual / predicted seconds (None before the model was ready)."""
        self._errors: deque[float] = deque(maxlen=window)

    @property
    def margin(self) -> float:
        """How much longer than predicted batches have recently run: the 90th percentile of actual
        / predicted over the window, at least 1. Admission multiplies its predictions by it, so a
        backend whose times scatter (a shared CPU or GPU) is not promised what it misses one time
        in ten."""
        if len(self._errors) < 8:
            return 1.0
        ordered = sorted(self._errors)
        return max(1.0, ordered[int(0.9 * (len(ordered) - 1))])

    @property
    def fit(self) -> Fit | None:
        """The current fit, or None before the first batch."""
        return self._fit

    def observe(self, size: int, seconds: float) -> None:
        """Add one finished batch and refit."""
        if size < 1 or seconds < 0:
            return
        if self._fit is not None:
            predicted = self._fit.seconds(size)
            self.last_error = seconds / predicted if predicted > 0 else None
            if self.last_error is not None:
                self._errors.append(self.last_error)
        self._samples.append((size, seconds))
        self._fit = _least_squares(self._samples, self._fit)


def _least_squares(samples: deque[tuple[int, float]], previous: Fit | None) -> Fit:
    count = len(samples)
    mean_n = sum(n for n, _ in samples) / count
    mean_t = sum(t for _, t in samples) / count
    var_n = sum((n - mean_n) ** 2 for n, _ in samples)
    if var_n == 0:  # one size: keep the slope known, re-anchor the intercept (or all of it per call)
        a = previous.a if previous is not None else 1e-9
        if mean_t - a * mean_n < 0:
            return Fit(a=mean_t / mean_n, b=0.0)
        return Fit(a=a, b=mean_t - a * mean_n)
    a = sum((n - mean_n) * (t - mean_t) for n, t in samples) / var_n
    # Noise can make a line through few points slope down or cross below zero: neither is a
    # backend, so clamp to the nearest sensible model rather than let a negative cost drive the
    # policy.
    if a <= 0:  # flat: the batch size does not show in the time, all of it is the call's
        return Fit(a=1e-9, b=mean_t)
    b = mean_t - a * mean_n
    if b < 0:
        return Fit(a=mean_t / mean_n, b=0.0)
    return Fit(a=a, b=b)


class AdaptivePolicy:
    """How many images a batch waits for, and how long a request would wait, from the learned
    batch times (:class:`BatchLatencyModel`) and the arrival rate. The batcher tells it what
    arrived and what each batch cost; it holds no clock or task of its own."""

    def __init__(self, max_batch_size: int, slots: int, window: int = 64) -> None:
        self.model = BatchLatencyModel(window)
        self.max_batch_size = max_batch_size
        self.slots = slots
        """Batches the backend may run at once."""
        self.rate = 0.0
        """The latest arrival-rate estimate, images per second."""
        self._arrivals = 0
        self._rate_at: float | None = None

    def arrived(self, count: int) -> None:
        self._arrivals += count

    def arrival_rate(self, now: float) -> float:
        """Images admitted per second, exponentially weighted over ``RATE_TIME_CONSTANT``; updated
        when the batcher looks (once per batch), not per request."""
        if self._rate_at is None:
            self._rate_at = now
            return self.rate
        elapsed = now - self._rate_at
        if elapsed >= 0.01:
            weight = 1.0 - math.exp(-elapsed / RATE_TIME_CONSTANT)
            self.rate += weight * (self._arrivals / elapsed - self.rate)
            self._arrivals = 0
            self._rate_at = now
        return self.rate

    def target(self, now: float) -> int:
        """The whole batch while the model is not ready, else the smallest n whose batches keep up
        with the arrivals: ``rate * (a*n + b) / n <= slots``, i.e. ``n >= rate*b / (slots - rate*a)``."""
        fit = self.model.fit
        if fit is None:
            return self.max_batch_size
        rate = self.arrival_rate(now) * HEADROOM
        spare = self.slots - rate * fit.a
        if spare <= 0:  # not even full batches keep up: make them full
            return self.max_batch_size
        return max(1, min(self.max_batch_size, math.ceil(rate * fit.b / spare)))

    def predicted_wait(self, ahead: int, inflight: int) -> float | None:
        """Seconds until the last of ``ahead`` queued images is answered, with ``inflight`` batches
        running now, from the learned batch times and how far they have recently been exceeded
        (None before the model has seen a batch)."""
        fit = self.model.fit
        if fit is None:
            return None
        batch = min(ahead, self.max_batch_size)
        waves = math.ceil(math.ceil(ahead / self.max_batch_size) / self.slots)
        busy = fit.seconds(self.max_batch_size) / 2 if inflight >= self.slots else 0.0
        return (busy + waves * fit.seconds(batch)) * self.model.margin
