"""What each backend can do, declared once, where the backends live: who holds the model, whether it
counts in the memory budget, what it computes in, which profiles and declared files it runs.

The rest of the gateway asks ``capabilities_of(settings)`` (keyed by ``runs_on``: what runs a
version's batches, the shared engine included) instead of reading ``settings.backend`` and deciding
for itself; a new backend is one row of ``CAPABILITIES`` and one builder of ``factory.BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.models.profiles import ModelProfile
from service.settings import Settings
from service.settings.values import setting_name


def _fp32(settings: Settings) -> str:
    return "fp32"


def _openvino_precision(settings: Settings) -> str:
    return settings.openvino_precision


def _torch_precision(settings: Settings) -> str:
    return "fp32" if settings.torch_device == "cpu" else settings.torch_precision


def _triton_precision(settings: Settings) -> str:
    return "as deployed in Triton"


def _no_precision(settings: Settings) -> str:
    return "none"


@dataclass(frozen=True)
class Capabilities:
    """What one backend (a ``runs_on`` name) can do, and what the gateway may ask of it."""

    name: str
    """``runs_on``'s name: the ``backend`` label of a version's metrics, known before it loads."""
    in_budget: bool
    """Its model counts in ``GATEWAY_MODEL_MEMORY_BUDGET``: loaded on first use, unloaded to make room
    (Triton holds its own models)."""
    model_elsewhere: bool
    """Its model runs in another process (Triton, the shared engine): whether it is loaded there is
    known from the version's readiness check only."""
    estimates_memory: bool
    """Its memory in the budget can be estimated from its model file; without (the torch backend
    builds none), a version under the budget must say its ``memory``."""
    on_triton: bool
    """Its model is Triton's: loaded and unloaded through Triton's repository API, listed in its index."""
    precision: Callable[[Settings], str]
    """What it computes in, as far as the gateway decides it."""
    declared_formats: frozenset[str] = frozenset()
    """The declared model files it runs (none: built-in profiles only)."""
    only_profiles: frozenset[str] | None = None
    """The built-in profiles it runs, where not every one (None: all)."""
    batches_on_own_cores: bool = False
    """Its batches in flight each run on their own part of the CPU (the in-process CPU runtimes
    split the cores between ``max_inflight_batches``): a free batch slot is idle cores, so the
    batcher sends what is queued at once rather than wait for a fuller batch while another runs.
    Without (Triton, a GPU), any batch in flight keeps the device busy, and waiting fills the next."""
    merges_batches: bool = False
    """It merges what it is sent into batches of its own (the shared engine, across the workers): a
    worker's batch waiting to fill behind its other batch in flight only adds that wait to the
    engine's own, so a free slot sends at once (on an H200 at 2,000 requests/s that wait was half of
    the p99: docs/bench/gpu/issue49)."""

    @property
    def sends_at_once(self) -> bool:
        """A free batch slot sends what is queued at once, not waiting for a fuller batch while
        another batch runs (``DynamicBatcher``'s ``busy_at``: every slot, not one)."""
        return self.batches_on_own_cores or self.merges_batches


_ENGINE_PROFILES = frozenset({"resnet50"})

CAPABILITIES: dict[str, Capabilities] = {
    "embedded": Capabilities(
        "embedded",
        in_budget=True,
        model_elsewhere=False,
        estimates_memory=True,
        on_triton=False,
        precision=_fp32,
        declared_formats=frozenset({"onnx"}),
        batches_on_own_cores=True,
    ),
    "openvino": Capabilities(
        "openvino",
        in_budget=True,
        model_elsewhere=False,
        estimates_memory=True,
        on_triton=False,
        precision=_openvino_precision,
        declared_formats=frozenset({"onnx", "openvino"}),
        batches_on_own_cores=True,
    ),
    "torch": Capabilities(
        "torch",
        in_budget=True,
        model_elsewhere=False,
        estimates_memory=False,
        on_triton=False,
        precision=_torch_precision,
        only_profiles=frozenset({"resnet50"}),  # ResNet-50's graph, and no other, in PyTorch
    ),
    # a worker of the shared torch engine: the engine's own settings say what it runs, checked where
    # it starts; its memory is counted as the torch backend's would be
    "engine": Capabilities(
        "engine",
        in_budget=True,
        model_elsewhere=True,
        estimates_memory=False,
        on_triton=False,
        precision=_torch_precision,
        merges_batches=True,
    ),
    # the file as ``gateway models triton-repo`` writes it into Triton's repository, or a model
    # already in the user's Triton (``triton``)
    "triton": Capabilities(
        "triton",
        in_budget=False,
        model_elsewhere=True,
        estimates_memory=False,
        on_triton=True,
        precision=_triton_precision,
        declared_formats=frozenset({"onnx", "triton"}),
    ),
    "fake": Capabilities(
        "fake",
        in_budget=True,
        model_elsewhere=False,
        estimates_memory=True,
        on_triton=False,
        precision=_no_precision,
        declared_formats=frozenset({"onnx", "openvino", "torch"}),
    ),
}
"""Every ``runs_on`` name's capabilities (``GATEWAY_BACKEND``'s values, and ``engine``)."""


def shares_engine(settings: Settings) -> bool:
    """The torch backend with ``GATEWAY_TORCH_ENGINE=shared``: one engine process holds the model,
    the HTTP workers are its clients (it serves one model version)."""
    return settings.backend == "torch" and settings.torch_engine == "shared"


def runs_on(settings: Settings) -> str:
    """What runs a version's batches: its backend, or ``engine`` for a worker of a shared engine
    (the engine's own settings say which backend it runs, checked where the engine starts)."""
    if shares_engine(settings) and settings.engine_socket:
        return "engine"
    return settings.backend


def capabilities_of(settings: Settings) -> Capabilities:
    """What the backend running a version (``runs_on``) can do."""
    return CAPABILITIES[runs_on(settings)]


_KINDS = {"onnx": ".onnx", "openvino": "OpenVINO IR (.xml)", "torch": "torch (.pt2)", "triton": "Triton's models"}


def declared_problem(runs: str, profile: ModelProfile) -> str | None:
    """Why a backend (``runs_on``'s name) cannot run a declared model's file, or None."""
    assert profile.source is not None
    capabilities = CAPABILITIES[runs]
    formats = capabilities.declared_formats
    if profile.source.format in formats:
        return None
    if not formats:
        only = ", ".join(sorted(capabilities.only_profiles or _ENGINE_PROFILES))
        return f"runs the built-in {only} only; serve a declared model on embedded, openvino or triton"
    runs_files = ", ".join(_KINDS[f] for f in sorted(formats))
    return f"does not run {_KINDS[profile.source.format]} files; it runs {runs_files}"


def run_problem(settings: Settings, profile: ModelProfile, *, own: bool) -> str | None:
    """Why a version's backend cannot run its model (a built-in profile it does not have, a declared
    file it does not read), naming the backend as configured (``own``: by the models file, else by
    its setting), or None."""
    named = "" if own else f" ({setting_name('backend')})"
    runs = runs_on(settings)
    if profile.source is not None:
        problem = declared_problem(runs, profile)
        return None if problem is None else f"the {settings.backend} backend{named} {problem}"
    only = CAPABILITIES[runs].only_profiles
    if only is not None and profile.name not in only:
        return (
            f"{profile.name} cannot run on the {settings.backend} backend{named}, which serves "
            f"{', '.join(sorted(only))} only"
        )
    return None


def budget_problem(settings: Settings, memory: int | None) -> str | None:
    """Under ``GATEWAY_MODEL_MEMORY_BUDGET``: why a version's memory cannot be counted (its backend's
    cannot be estimated and it gives none), or None."""
    if memory is None and not capabilities_of(settings).estimates_memory:
        return (
            f"the {settings.backend} backend's memory cannot be estimated under "
            f"{setting_name('model_memory_budget')}: give it memory = BYTES in a models file "
            f"({setting_name('models_file')})"
        )
    return None
