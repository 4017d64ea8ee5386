"""The models a process serves, running: each version's classifier, backend and readiness, and
the choice of a version for a request (weighted by traffic, optionally sticky per API key)."""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import math
import random
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from service.backends.base import Backend
from service.backends.capabilities import capabilities_of
from service.backends.health import BackendHealth
from service.classifier import Classifier
from service.errors import NotFound
from service.images.budget import BudgetShare
from service.images.preprocess import PreprocessConfig
from service.metrics import ModelMetrics
from service.models.checkpoints import weights_for
from service.schemas import VersionState
from service.serving.catalog import ModelSpec, VersionSpec
from service.serving.fair import Lane
from service.serving.statistics import VersionStatistics

FAILED_LOAD_BACKOFF = 30.0
"""Seconds a version whose load failed is refused at once (its failure said) before a load is tried again."""


@dataclass
class Running:
    """A loaded model version: what serves its requests, and its readiness check's task."""

    classifier: Classifier
    backend: Backend
    health: BackendHealth
    watcher: asyncio.Task[None]


@dataclass
class ServedVersion:
    model: str
    spec: VersionSpec
    metrics: ModelMetrics
    executor: Executor
    """Where its images are decoded: its model's lane of the shared pool, or the pool."""
    running: Running | None = None
    """None while it is not loaded (with a memory budget, it loads on first use)."""
    lazy: bool = False
    """Loaded on first use and unloaded when the memory budget needs its room (``Loader``)."""
    in_use: int = 0
    """Requests holding it now: it is not unloaded while any does (a drain waits for them)."""
    waiting: int = 0
    """Requests waiting for its load (or, draining, its reload): it is not idle while any does."""
    draining: bool = False
    """Its turn in the memory budget is over: new requests wait for its reload, and it is unloaded
    once the requests holding it are answered (``Loader``)."""
    loading: bool = False
    """A load of it is under way (``Loader``)."""
    last_used: float = 0.0
    loaded_at: float = 0.0
    """When it was last loaded (monotonic): it is drained for another only after a while (``Loader``)."""
    failed: tuple[float, str] | None = None
    """When its last load failed, and why (cleared by a load that succeeds)."""
    held: int = 0
    """Requests inside ``ServedModels.hold`` with it (loading it or holding it loaded): a version a
    reload retires is stopped once none is."""
    retired: bool = False
    """A reload removed or replaced it: no new request picks it; those that chose it before are served."""
    stopping: bool = False
    """Retired and drained: it is being stopped, a request that chose it goes to its replacement."""
    idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    """Set while no request holds it (``held`` 0): what a retired version's drain waits for."""
    statistics: VersionStatistics = field(default_factory=VersionStatistics, repr=False, compare=False)
    """Its requests and batches, counted for the protocol's statistics (``service.serving.statistics``)."""
    random_weights: bool = field(init=False)
    """Its answers are meaningless: a profile with random weights and no weights file (found once,
    at start: its answers, readiness and jobs say it without a file lookup each)."""

    def __post_init__(self) -> None:
        self.idle.set()
        profile = self.spec.profile
        self.random_weights = profile.random_without_weights and weights_for(self.spec.settings, profile.name) is None

    @property
    def config(self) -> PreprocessConfig:
        """How its images are decoded and checked (known without loading it)."""
        profile = self.spec.profile
        return PreprocessConfig(
            profile.height, profile.width, profile.resize, profile.crop_fraction, self.spec.settings.max_image_bytes
        )

    @property
    def failure(self) -> str | None:
        """Why its last load failed, while that is recent: it is refused at once until then."""
        if self.failed is None or time.monotonic() - self.failed[0] > FAILED_LOAD_BACKOFF:
            return None
        return self.failed[1]

    @property
    def retry_in(self) -> int:
        """Whole seconds (at least 1) until a load of it is tried again after a failed one."""
        since = time.monotonic() - self.failed[0] if self.failed is not None else FAILED_LOAD_BACKOFF
        return max(1, math.ceil(FAILED_LOAD_BACKOFF - since))

    @property
    def version(self) -> str:
        return self.spec.version

    @property
    def classifier(self) -> Classifier:
        assert self.running is not None, f"{self.model}/{self.version} is not loaded"
        return self.running.classifier

    @property
    def backend(self) -> Backend:
        assert self.running is not None, f"{self.model}/{self.version} is not loaded"
        return self.running.backend

    @property
    def backend_name(self) -> str:
        return self.running.backend.name if self.running is not None else capabilities_of(self.spec.settings).name

    @property
    def state(self) -> tuple[VersionState, str | None]:
        """Where it stands, and why when it is unavailable or failed."""
        if self.running is not None:
            problem = self.running.health.problem
            return (VersionState.READY, None) if problem is None else (VersionState.UNAVAILABLE, problem)
        if self.loading:
            return VersionState.LOADING, None
        if (failure := self.failure) is not None:
            return VersionState.FAILED, failure
        # not started: a lazy version until its first request; any other only while the gateway starts
        return (VersionState.UNLOADED if self.lazy else VersionState.LOADING), None

    @property
    def loaded(self) -> bool:
        """Its model is in memory where it runs: started here, or, in Triton or the shared engine, as
        far as the latest readiness check says (an unreachable one is not taken to hold it)."""
        if self.running is None:
            return False
        return self.running.health.problem is None or not capabilities_of(self.spec.settings).model_elsewhere

    @property
    def problem(self) -> str | None:
        """None when its backend was ready at the last check (or, not loaded, when it loads on
        first use), else why not."""
        if self.running is None:
            return self.failure if self.lazy else "not started"
        return self.running.health.problem


@dataclass
class ServedModel:
    spec: ModelSpec
    versions: dict[str, ServedVersion]
    lane: Lane | None = None
    """Its lane of the shared decode pool (None: the only model, it has the pool)."""
    memory: BudgetShare | None = None
    """Its share of the decoder memory budget (None: first come, first served)."""
    _bounds: list[float] = field(default_factory=list)
    _by_bound: list[ServedVersion] = field(default_factory=list)
    _weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.route(self.spec)

    @property
    def name(self) -> str:
        return self.spec.name

    def route(self, spec: ModelSpec) -> None:
        """Take the traffic weights (and sticky) of ``spec``, this model's entry of a reloaded catalog."""
        taking = [self.versions[v.version] for v in spec.versions if v.traffic > 0]
        weights = [v.traffic for v in spec.versions if v.traffic > 0]
        total = sum(weights)
        bounds = [bound / total for bound in itertools.accumulate(weights)]
        # on the event loop, like ``pick``: no request sees one without the other
        self.spec, self._bounds, self._by_bound, self._weights = spec, bounds, taking, weights
        if self.lane is not None:
            self.lane.share = spec.share
        if self.memory is not None:
            self.memory.budget.reweigh(self.memory, spec.share)

    def pick(self, key: str | None) -> ServedVersion:
        """A version for an unversioned request: by traffic weight, at random, or with ``sticky``
        the same for every request of an API key (while the weights stay as they are). A version
        whose backend is not ready is passed over while another taking traffic is ready: the
        model is ready as long as one is, so its requests go there."""
        taking = self._by_bound
        if len(taking) == 1:
            return taking[0]
        if self.spec.sticky and key is not None:
            digest = hashlib.blake2b(f"{self.name}\0{key}".encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "big") / 2**64
        else:
            point = random.random()  # routing, not security
        chosen = taking[min(bisect.bisect_right(self._bounds, point), len(taking) - 1)]
        if chosen.problem is None:
            return chosen
        ready = [
            (served, weight) for served, weight in zip(taking, self._weights, strict=True) if served.problem is None
        ]
        if not ready:
            return chosen  # none is: its own error says why
        total = sum(weight for _, weight in ready)
        at = point * total
        for served, weight in ready:
            at -= weight
            if at < 0:
                return served
        return ready[-1][0]

    def version(self, version: str) -> ServedVersion:
        served = self.versions.get(version)
        if served is None:
            shown = quoted(version, 16, "version")
            raise NotFound(f"model {self.name!r} has no version {shown}; it has {', '.join(self.versions)}")
        return served

    @property
    def problem(self) -> str | None:
        """None when a version taking traffic is ready (the model can answer), else why not."""
        problems = [f"version {v.version}: {v.problem}" for v in self._by_bound if v.problem is not None]
        return "; ".join(problems) if len(problems) == len(self._by_bound) else None


def quoted(text: str, most: int, what: str) -> str:
    """A name from a request, quoted in an error; a long one by its length only."""
    return repr(text) if len(text) <= most else f"(a {what} of {len(text)} characters)"
