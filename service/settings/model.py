"""The settings one model may set for itself: its backend, its batcher and its breaker.

``ModelFields`` declares them once, with their types, bounds and docstrings: ``Settings`` inherits
them as the gateway's values (``GATEWAY_BACKEND``, ``GATEWAY_MAX_BATCH_SIZE``...), and
``ModelSettings`` is one model version's own, a models file's ``[models.NAME]`` and
``[models.NAME.versions.N]`` keys of the same names checked as one class, its defaults taken from
the gateway's settings (``service.serving.catalog``). What belongs to the whole gateway (decode
pool, byte budgets, admission, timeouts) is not here, so a models file cannot set it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from service.settings.values import MAX_INT, TORCH_DEVICE, host_port, triton_model_name


class ModelFields(BaseModel):
    """The per-model settings: what runs one model version's batches, and how they are formed."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    backend: Literal["embedded", "openvino", "torch", "triton", "fake"] = "embedded"
    """Where batches run: ``embedded`` (ONNX Runtime in this process, on CPU), ``openvino`` (the
    model converted by OpenVINO for this CPU, in this process; see ``openvino_precision``;
    ``pip install '.[openvino]'``, which ``scripts/bootstrap test`` does; in the image:
    ``docker build --build-arg EXTRAS=triton,openvino``), ``torch`` (ResNet-50
    in PyTorch in this process, on a CUDA GPU; see ``torch_device``; ``pip install '.[torch]'``),
    ``triton`` (NVIDIA Triton Inference Server, see the ``triton_*`` settings) or ``fake`` (a
    deterministic stand-in with no model, for testing the gateway itself)."""
    openvino_precision: Literal["fp32", "bf16", "int8"] = "bf16"
    """Precision of the ``openvino`` backend: ``bf16`` (where the CPU has bfloat16 kernels, else
    fp32, said in /readyz's ``runtime`` check), ``fp32``, or ``int8`` (quantised on ``calibration_dir``'s
    photos, or a model built by ``gateway models quantize``). See docs/performance/precision.md."""
    torch_device: str = "cuda"
    """Device of the ``torch`` backend: ``cuda``, ``cuda:N``, or ``cpu`` (for trying it without a GPU; always
    fp32 there)."""
    torch_precision: Literal["fp16", "fp32"] = "fp16"
    """Precision of the ``torch`` backend on a GPU: ``fp16`` (BatchNorms folded, channels-last) or ``fp32``
    (on the CPU it always runs fp32)."""

    fake_delay: float = Field(0.0, ge=0.0)
    """Seconds the ``fake`` backend takes per batch (to simulate a slow model in tests and drills)."""
    breaker_threshold: int = Field(5, ge=0)
    """Consecutive failed batches that open the backend's circuit breaker (0: no breaker)."""
    breaker_cooldown: float = Field(5.0, gt=0.0)
    """Seconds an open circuit refuses work (503) before letting one trial batch through; the
    readiness check sends that trial itself when the backend says it is ready."""

    model_weights: Path | None = None
    """Weights file for the model (a PyTorch state_dict, legacy or zip format); default: the checkpoint
    ``gateway models fetch`` kept in ``models_dir``, else the packaged weights for EfficientNet-Lite0
    and random He-initialised weights for ResNet-50 (flagged ``random_weights`` in every answer)."""
    embedded_threads: int = Field(0, ge=0)
    """Threads per batch of the in-process backends, ``embedded`` and ``openvino`` (0: the cores shared out
    among the in-flight batches, so that batches running together do not oversubscribe the CPU)."""
    triton_url: Annotated[str, AfterValidator(host_port)] = "127.0.0.1:8001"
    """Triton's address, host:port: its gRPC port (8001) or, with ``triton_protocol=http``, its
    HTTP port (8000)."""
    triton_protocol: Literal["grpc", "http"] = "grpc"
    """How the gateway talks to Triton: asynchronous gRPC (the default) or asynchronous HTTP."""
    triton_model: Annotated[str | None, AfterValidator(triton_model_name)] = None
    """Model name in Triton's repository (default: the ``model`` setting)."""
    triton_model_version: str = ""
    """Model version to ask Triton for ("" lets Triton pick by its version policy)."""
    triton_shared_memory: bool = False
    """Pass tensors through system shared memory instead of the socket; only when the gateway and
    Triton share a host (and, in containers, an IPC namespace)."""

    max_batch_size: int = Field(16, ge=1, le=1024)
    """Most images the batcher puts in one backend call."""
    max_delay: float = Field(0.005, ge=0.0, le=10.0)
    """Seconds the batcher waits for a batch to fill while the backend is busy (Triton, a GPU: a
    batch is in it; the in-process CPU runtimes: every one of ``max_inflight_batches``, as a free
    one is idle cores); an idle backend gets a lone request at once. With the adaptive policy, the
    most it may wait."""
    batch_policy: Literal["fixed", "adaptive"] = "fixed"
    """How long a batch waits to fill while the backend is busy: ``fixed`` waits for
    ``max_batch_size`` images or ``max_delay``; ``adaptive`` learns the backend's batch time
    (``a * n + b``) and the arrival rate, waits only for the smallest batch that keeps up, and
    refuses at once (429 ``deadline_unmeetable``) a request the queue ahead would make miss its
    deadline (see docs/tuning.md)."""
    max_inflight_batches: int = Field(2, ge=1, le=64)
    """Batches in the backend at once: more than one lets the next batch form while one runs."""
    max_queue_size: int = Field(256, ge=1)
    """Images waiting for a batch; beyond it requests are rejected with 429."""

    @field_validator("torch_device", mode="after")
    @classmethod
    def _a_device(cls, value: str) -> str:
        """A device PyTorch would refuse only once the model loads is refused here."""
        if not TORCH_DEVICE.fullmatch(value):
            raise ValueError(f"{value!r} is not cpu, cuda or cuda:N")
        return value


class ModelSettings(ModelFields):
    """One model version's own settings, as a models file gives them (unknown keys, inf and nan
    refused); what it leaves out is the gateway's (``ModelSettings.of``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, use_attribute_docstrings=True)

    @classmethod
    def of(cls, settings: ModelFields) -> ModelSettings:
        """The gateway's per-model values (``settings``: a ``Settings``), as one model's."""
        return cls.model_validate({name: getattr(settings, name) for name in cls.model_fields})

    @field_validator("*", mode="after")
    @classmethod
    def _fits_in_64_bits(cls, value: object) -> object:
        """As ``Settings`` refuses them: a number over a signed 64-bit integer, by name."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"{value} is too large (at most 2**63 - 1)")
        return value
