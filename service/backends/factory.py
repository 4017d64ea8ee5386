"""The one table of backends: a ``GATEWAY_BACKEND`` name to the function that builds it.

Each builder imports its backend when called (as uvicorn's config tables do), so that a gateway on
the embedded default never imports PyTorch, OpenVINO or tritonclient. Every process that runs a
model (the HTTP workers, the queue workers, the shared engine) builds it here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from service.backends.base import Backend
from service.backends.capabilities import CAPABILITIES, runs_on
from service.models.checkpoints import weights_for
from service.models.profiles import ModelProfile
from service.models.store import ensure_model
from service.settings import Settings

Builder = Callable[[Settings, ModelProfile], Awaitable[Backend]]


async def _fake(settings: Settings, profile: ModelProfile) -> Backend:
    from service.backends.fake import FakeBackend

    return FakeBackend(classes=profile.outputs, delay=settings.fake_delay)


async def _triton(settings: Settings, profile: ModelProfile) -> Backend:
    """A model of Triton's: the gateway's wire (built-in, or a declared file written by
    ``gateway models triton-repo``), or a model already in the user's Triton in its own dtype
    and layout (``declared``)."""
    from service.backends.triton import TritonBackend

    resident = profile.source is not None and profile.source.format == "triton"
    return TritonBackend(
        url=settings.triton_url,
        model=settings.triton_model or profile.name,
        version=settings.triton_model_version,
        protocol=settings.triton_protocol,
        input_size=profile.input_size,
        classes=profile.outputs,
        max_batch_size=settings.max_batch_size,
        shared_memory=settings.triton_shared_memory,
        shared_memory_regions=settings.max_inflight_batches,
        declared=profile if resident else None,
    )


async def _engine(settings: Settings, profile: ModelProfile) -> Backend:
    """A worker's client of the shared engine (``GATEWAY_TORCH_ENGINE=shared``)."""
    from service.backends.engine import EngineClient, Geometry

    assert settings.engine_socket is not None
    return EngineClient(
        settings.engine_socket,
        Geometry(profile.height, profile.outputs),
        max_batch_size=settings.max_batch_size,
        slots=settings.max_inflight_batches,
        pool_images=settings.max_queue_size + settings.max_inflight_batches * settings.max_batch_size,
        down_limit=settings.engine_down_limit,
    )


async def _torch(settings: Settings, profile: ModelProfile) -> Backend:
    from service.backends.torch_backend import TorchBackend

    if profile.name not in (CAPABILITIES["torch"].only_profiles or ()):  # the catalog refuses it at start already
        raise ValueError(f"the torch backend serves resnet50, not {profile.name}")
    return TorchBackend(
        weights_for(settings, profile.name),
        device=settings.torch_device,
        precision=settings.torch_precision,
        cuda_graphs=settings.torch_cuda_graphs,
        sync=settings.torch_sync,
        compile=settings.torch_compile,
        image_size=profile.height,
        max_batch_size=settings.max_batch_size,
        max_concurrency=settings.max_inflight_batches,
    )


async def _onnx_file(settings: Settings, profile: ModelProfile) -> Path:
    """The model file an in-process backend loads: built (a declared model: derived from its file,
    which is its weights) if missing or stale."""
    weights = weights_for(settings, profile.name) if profile.source is None else None
    return await asyncio.to_thread(ensure_model, settings.models_dir, profile, weights)


async def _openvino(settings: Settings, profile: ModelProfile) -> Backend:
    from service.backends.openvino import OpenVINOBackend

    path = await _onnx_file(settings, profile)
    if settings.openvino_precision == "int8":
        from service.models.quantize import ensure_int8

        path = await asyncio.to_thread(ensure_int8, settings.models_dir, profile, path, settings.calibration_dir)
    return OpenVINOBackend(
        path,
        precision=settings.openvino_precision,
        threads=settings.embedded_threads_per_batch,
        max_concurrency=settings.max_inflight_batches,
    )


async def _embedded(settings: Settings, profile: ModelProfile) -> Backend:
    from service.backends.embedded import EmbeddedBackend

    return EmbeddedBackend(
        await _onnx_file(settings, profile),
        intra_op_threads=settings.embedded_threads_per_batch,
        max_concurrency=settings.max_inflight_batches,
    )


BACKENDS: dict[str, Builder] = {
    "embedded": _embedded,
    "openvino": _openvino,
    "torch": _torch,
    "triton": _triton,
    "fake": _fake,
}
"""``GATEWAY_BACKEND``'s values (the settings' ``backend`` field lists the same names; what each can do:
``service.backends.capabilities``)."""


def host_problem(settings: Settings) -> str | None:
    """Why this host cannot run a version's backend as its settings say (checked before anything
    starts, so a server never comes up unable to serve), or None: the torch backend on a CUDA device
    PyTorch does not see, or without PyTorch installed."""
    if runs_on(settings) != "torch" or not settings.torch_device.startswith("cuda"):
        return None  # (PyTorch is imported only to ask about a GPU: on the CPU the load says enough)
    try:
        from service.backends.torch_backend import cuda_problem
    except ImportError:
        return "the torch backend needs PyTorch, which is not installed here (pip install '.[torch]')"
    return cuda_problem(settings.torch_device)


async def build_backend(settings: Settings, profile: ModelProfile) -> Backend:
    """The configured backend for ``profile``, not started; a worker of a shared engine gets the
    engine's client instead of its own model."""
    if runs_on(settings) == "engine":
        return await _engine(settings, profile)
    return await BACKENDS[settings.backend](settings, profile)
