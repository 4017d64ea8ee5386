"""What ``gateway tune`` searches and how: candidates (batch policy, batch size, delay, in-flight
batches, workers, and with a Triton repository Triton's instance count and queue delay), the target
they must meet, and a coarse-to-fine search that ends in successive halving.

1. **Coarse**: a spread of batch sizes (every other value of the space) with the other settings at
   their defaults, under each batch policy.
2. **Refine**: coordinate descent from each of the best few coarse candidates: each setting in
   turn moves one step up and down its list of values, and the candidate moves with any
   improvement; passes repeat until nothing improves (one pass with ``--quick``).
3. **Halve**: the best few are measured again for longer, the better half kept, until one is
   left: short screening runs choose where to look; the longer runs decide.

A candidate's score is the most throughput it reached, over a sweep of concurrent clients, with
p99 within the target and (almost) nothing refused. The search only sees ``measure``, so tests can
drive it on a simulated gateway.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

POLICIES = ("fixed", "adaptive")


@dataclass(frozen=True)
class Candidate:
    """The settings a tune varies (``GATEWAY_*`` names in :meth:`env`)."""

    policy: str = "fixed"
    batch: int = 16
    delay_ms: float = 5.0
    inflight: int = 2
    workers: int = 1
    triton_instances: int | None = None
    """Model instances per instance group in Triton's config (None: not tuned)."""
    triton_delay_us: int | None = None
    """Triton's ``dynamic_batching.max_queue_delay_microseconds`` (None: not tuned)."""

    def env(self) -> dict[str, str]:
        return {
            "GATEWAY_BATCH_POLICY": self.policy,
            "GATEWAY_MAX_BATCH_SIZE": str(self.batch),
            "GATEWAY_MAX_DELAY": f"{self.delay_ms / 1000:g}",
            "GATEWAY_MAX_INFLIGHT_BATCHES": str(self.inflight),
            "GATEWAY_WORKERS": str(self.workers),
        }

    def server(self) -> dict[str, int]:
        """The Triton model configuration fields this candidate sets (empty when Triton is not tuned)."""
        fields = {
            "instance_group.count": self.triton_instances,
            "dynamic_batching.max_queue_delay_microseconds": self.triton_delay_us,
        }
        return {name: value for name, value in fields.items() if value is not None}

    @property
    def label(self) -> str:
        label = f"{self.policy} b{self.batch} d{self.delay_ms:g}ms i{self.inflight} w{self.workers}"
        if self.triton_instances is not None:
            label += f" t{self.triton_instances}"
        if self.triton_delay_us is not None:
            label += f" q{self.triton_delay_us}us"
        return label


DIMENSIONS = ("batch", "triton_instances", "delay_ms", "policy", "inflight", "workers", "triton_delay_us")
"""The order refinement walks the settings in: batch size matters most, then (on Triton) how many
model instances run batches at once."""


@dataclass(frozen=True)
class Level:
    """One closed-loop run of a candidate at ``concurrency`` clients."""

    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float
    failure_share: float


@dataclass(frozen=True)
class Target:
    slo_p99_ms: float
    min_throughput: float = 0.0
    headroom: float = 0.8
    """Candidates are judged against ``slo_p99_ms * headroom``, so that the settings chosen still
    meet the SLO on a later, noisier run."""
    max_failure_share: float = 0.001

    @property
    def p99_ms(self) -> float:
        return self.slo_p99_ms * self.headroom

    def meets(self, level: Level) -> bool:
        return level.p99_ms <= self.p99_ms and level.failure_share <= self.max_failure_share


@dataclass
class Trial:
    candidate: Candidate
    stage: str
    seconds: float
    """Measured seconds per concurrency level."""
    levels: list[Level] = field(default_factory=list)
    error: str | None = None
    """Why it could not be measured (the gateway did not start with these settings...)."""
    chosen: bool = False

    def best(self, target: Target) -> Level | None:
        """The level with the most throughput that meets the target."""
        meeting = [level for level in self.levels if target.meets(level)]
        return max(meeting, key=lambda level: level.throughput, default=None)

    def score(self, target: Target) -> tuple[float, float, float]:
        """Larger is better: meets the target, then throughput, then lower p99. A candidate that
        never meets it ranks by how close its lowest p99 came."""
        best = self.best(target)
        if best is not None:
            return (1.0, best.throughput, -best.p99_ms)
        lowest = min((level.p99_ms for level in self.levels), default=float("inf"))
        return (0.0, 0.0, -lowest)

    def feasible(self, target: Target) -> bool:
        best = self.best(target)
        return best is not None and best.throughput >= target.min_throughput


@dataclass(frozen=True)
class Space:
    """The values each setting may take, in order (refinement steps to a neighbour)."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    delays_ms: tuple[float, ...] = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)
    policies: tuple[str, ...] = POLICIES
    inflights: tuple[int, ...] = (1, 2, 4)
    workers: tuple[int, ...] = (1, 2)
    triton_instances: tuple[int, ...] = ()
    """Empty: Triton's instance count is not tuned."""
    triton_delays_us: tuple[int, ...] = ()
    """Empty: Triton's queue delay is not tuned."""
    defaults: Candidate = Candidate()
    """Where the search starts (the nearest value in the space for each setting): the gateway's
    defaults, and Triton's settings as its repository holds them."""

    def values(self, dimension: str) -> Sequence[object]:
        return {
            "batch": self.batches,
            "delay_ms": self.delays_ms,
            "policy": self.policies,
            "inflight": self.inflights,
            "workers": self.workers,
            "triton_instances": self.triton_instances,
            "triton_delay_us": self.triton_delays_us,
        }[dimension]

    def start(self) -> Candidate:
        """The defaults where the space holds them, else the nearest value."""
        default = self.defaults

        def near(values: Sequence[float], value: float | None) -> Any:
            if not values:
                return None
            if value is None:
                return values[0]
            return value if value in values else min(values, key=lambda v: abs(v - value))

        return Candidate(
            policy=default.policy if default.policy in self.policies else self.policies[0],
            batch=near(self.batches, default.batch),
            delay_ms=near(self.delays_ms, default.delay_ms),
            inflight=near(self.inflights, default.inflight),
            workers=near(self.workers, default.workers),
            triton_instances=near(self.triton_instances, default.triton_instances),
            triton_delay_us=near(self.triton_delays_us, default.triton_delay_us),
        )

    def coarse(self) -> list[Candidate]:
        start = self.start()
        batches = self.batches[::2] if self.batches[-1] in self.batches[::2] else (*self.batches[::2], self.batches[-1])
        return [replace(start, batch=b, policy=p) for p in self.policies for b in batches]

    def neighbours(self, candidate: Candidate, dimension: str) -> list[Candidate]:
        values = list(self.values(dimension))
        if not values:
            return []
        here = values.index(getattr(candidate, dimension))
        steps: list[dict[str, Any]] = [{dimension: values[i]} for i in (here - 1, here + 1) if 0 <= i < len(values)]
        return [replace(candidate, **step) for step in steps]


@dataclass(frozen=True)
class Plan:
    """How much measuring each stage gets."""

    concurrency: tuple[int, ...]
    """Client counts each candidate is swept over (in order; the sweep stops early)."""
    screen_seconds: float
    finalists: int
    final_seconds: float
    refine_passes: int
    beam: int
    """Coarse candidates each refinement starts from: settings interact (a larger batch may win on
    one worker and lose on two), so one greedy descent can stop short."""

    @classmethod
    def make(cls, quick: bool, max_concurrency: int) -> Plan:
        step = 4 if quick else 2
        levels = [1]
        while levels[-1] * step <= max_concurrency:
            levels.append(levels[-1] * step)
        if levels[-1] != max_concurrency:
            levels.append(max_concurrency)
        if quick:
            return cls(tuple(levels), screen_seconds=1.0, finalists=2, final_seconds=2.0, refine_passes=1, beam=2)
        return cls(tuple(levels), screen_seconds=2.0, finalists=4, final_seconds=4.0, refine_passes=3, beam=3)


Measure = Callable[[Candidate, Sequence[int], float, str], Awaitable[Trial]]
"""``measure(candidate, concurrency levels, seconds per level, stage)``."""

Progress = Callable[[Trial], None]


async def search(
    measure: Measure, space: Space, target: Target, plan: Plan, progress: Progress | None = None
) -> list[Trial]:
    """Every trial made, in order; the winner has ``chosen`` set if any candidate met the target."""
    trials: list[Trial] = []
    screened: dict[Candidate, Trial] = {}

    async def screen(candidate: Candidate, stage: str) -> Trial:
        if candidate not in screened:
            trial = await measure(candidate, plan.concurrency, plan.screen_seconds, stage)
            screened[candidate] = trial
            trials.append(trial)
            if progress is not None:
                progress(trial)
        return screened[candidate]

    for candidate in space.coarse():
        await screen(candidate, "coarse")
    seeds = sorted(screened.values(), key=lambda t: t.score(target), reverse=True)[: plan.beam]
    for best in seeds:
        for _ in range(plan.refine_passes):
            moved = False
            for dimension in DIMENSIONS:
                for neighbour in space.neighbours(best.candidate, dimension):
                    trial = await screen(neighbour, "refine")
                    if trial.score(target) > best.score(target):
                        best, moved = trial, True
            if not moved:
                break

    ranked = sorted(screened.values(), key=lambda t: t.score(target), reverse=True)
    finalists = [t for t in ranked[: plan.finalists] if t.best(target) is not None]
    seconds = plan.final_seconds
    while finalists:
        round_trials = []
        for previous in finalists:
            levels = _around(plan.concurrency, previous.best(target))
            trial = await measure(previous.candidate, levels, seconds, f"final {seconds:g}s")
            trials.append(trial)
            round_trials.append(trial)
            if progress is not None:
                progress(trial)
        round_trials.sort(key=lambda t: t.score(target), reverse=True)
        if len(round_trials) == 1:
            if round_trials[0].feasible(target):
                round_trials[0].chosen = True
            break
        finalists = [t for t in round_trials[: max(1, len(round_trials) // 2)] if t.best(target) is not None]
        seconds *= 1.5
    return trials


def _around(levels: Sequence[int], best: Level | None) -> list[int]:
    """The screening's best client count and its neighbours in the sweep: where the final runs look."""
    if best is None:
        return list(levels)
    here = list(levels).index(best.concurrency) if best.concurrency in levels else 0
    return list(levels[max(0, here - 1) : here + 2])


def chosen(trials: Sequence[Trial]) -> Trial | None:
    return next((t for t in trials if t.chosen), None)
