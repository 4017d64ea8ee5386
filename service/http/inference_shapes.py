"""The Open Inference Protocol's answers about the server and its models, as dicts: the JSON that
Triton's REST API answers, and what ``google.protobuf.json_format.ParseDict`` takes into
``tritonclient``'s gRPC messages (``service_pb2``, ``model_config_pb2``), so the REST and gRPC
fronts say the same thing from one place.

Pure: they read the gateway's state and build plain values (no request, no I/O). An unknown model
or version is the gateway's ``NotFound`` (404), raised as the routes raise it.

* ``server_metadata``: ``ServerMetadataResponse``;
* ``model_metadata``: ``ModelMetadataResponse`` (its ``parameters`` are REST's only: the gRPC
  message has none, so ``ParseDict`` there takes ``ignore_unknown_fields=True``);
* ``model_config``: ``ModelConfig``, the version as the gateway serves it: what ``perf_analyzer``
  reads for the batch size and the input's type and shape;
* ``model_statistics``: ``ModelStatisticsResponse`` (``service.serving.statistics``);
* ``repository_index``: ``RepositoryIndexResponse.ModelIndex`` items.

The model takes encoded images: ``IMAGE`` is a ``BYTES`` tensor of one element per image
(``[-1, 1]``, as Triton reports a batching model's ``[1]`` input), ``PROBABILITIES`` the model's
``FP32`` rows (``[-1, outputs]``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from service import __version__
from service.backends.capabilities import capabilities_of
from service.classifier import Classification
from service.http.gateway import Gateway
from service.http.inference_request import INPUT, OUTPUT
from service.schemas import VersionState
from service.serving.served import ServedModel, ServedVersion

SERVER_NAME = "inference-gateway"
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "model_configuration", "statistics"]
"""The protocol's extensions served here, by Triton's names: the classification extension on
``PROBABILITIES``, binary tensor data, the repository's index and load/unload, each version's
configuration and statistics. Not shared memory, tracing, logging, sequences or schedule policies."""

INT32_MAX = 2**31 - 1
"""``ModelConfig.max_batch_size`` is an int32."""

STATES: dict[VersionState, str] = {
    VersionState.READY: "READY",
    VersionState.UNAVAILABLE: "UNAVAILABLE",
    VersionState.LOADING: "LOADING",
    VersionState.UNLOADED: "UNAVAILABLE",
    VersionState.FAILED: "UNAVAILABLE",
}
"""The gateway's version states as Triton's repository index names them (Triton says an unloaded
model is ``UNAVAILABLE``, with ``unloaded`` as the reason)."""


def server_metadata() -> dict[str, Any]:
    """``GET /v2``: the server's name, version and the extensions it serves."""
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def platform(served: ServedVersion) -> str:
    """What runs the version, as the protocol's ``platform`` (Triton: ``onnxruntime_onnx``...)."""
    return f"{SERVER_NAME}/{served.backend_name}"


def model_metadata(gateway: Gateway, model: ServedModel, versions: list[ServedVersion]) -> dict[str, Any]:
    """A model's metadata, for ``versions`` (all of its own, or the one named). Its versions may
    differ in backend, not in what they take and give: the first one's inputs and outputs speak
    for them all."""
    first = versions[0]
    profile = first.spec.profile
    return {
        "name": model.name,
        "versions": [served.version for served in versions],
        "platform": platform(first),
        "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, profile.outputs]}],
        "parameters": {
            "image_size": profile.height,
            "input_size": [profile.height, profile.width],
            "output": profile.output,
            "max_images_per_request": gateway.settings.max_images_per_request,
        },
    }


def model_config(gateway: Gateway, served: ServedVersion) -> dict[str, Any]:
    """The version's configuration in Triton's ``config.pbtxt`` terms, as the gateway serves it:
    a request carries 1 to ``max_images_per_request`` images (``max_batch_size``), each one
    ``IMAGE`` element (``TYPE_STRING``, dims ``[1]``); the answer is ``PROBABILITIES`` (``TYPE_FP32``,
    ``[outputs]`` per image). ``dynamic_batching`` is its batcher's: the longest wait for a batch
    and the queue's bound in images. ``parameters`` say what the image becomes (input size, resize)
    and what the output means, and the backend's batch size, policy and precision."""
    settings, profile = served.spec.settings, served.spec.profile
    max_batch_size = min(gateway.settings.max_images_per_request, INT32_MAX)
    model = gateway.models.models.get(served.model)
    versions = list(model.versions) if model is not None else [served.version]
    batching: dict[str, Any] = {
        "max_queue_delay_microseconds": round(settings.max_delay * 1_000_000),
        "default_queue_policy": {"max_queue_size": settings.max_queue_size},
    }
    if settings.max_batch_size <= max_batch_size:
        batching["preferred_batch_size"] = [settings.max_batch_size]
    parameters = {
        "input_size": f"{profile.height}x{profile.width}",
        "resize": profile.resize,
        "crop_fraction": f"{profile.crop_fraction:g}",
        "output": profile.output,
        "backend": served.backend_name,
        "precision": capabilities_of(settings).precision(settings),
        "backend_max_batch_size": str(settings.max_batch_size),
        "batch_policy": settings.batch_policy,
        "max_inflight_batches": str(settings.max_inflight_batches),
    }
    if profile.output == "sigmoid":
        parameters["threshold"] = f"{profile.threshold:g}"
    return {
        "name": served.model,
        "platform": platform(served),
        "version_policy": {"specific": {"versions": [int(version) for version in versions]}},
        "max_batch_size": max_batch_size,
        "input": [{"name": INPUT, "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [profile.outputs]}],
        "dynamic_batching": batching,
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }


def model_statistics(gateway: Gateway, name: str | None, version: str | None) -> dict[str, Any]:
    """The statistics extension's answer: every version of every model (``name`` None; a
    ``version`` without a name is ignored, as Triton does), every version of ``name`` (``version``
    None), or the one named. 404 for a model or version not served."""
    if name is None:
        chosen = gateway.models.versions()
    else:
        model = gateway.models.get(name)
        chosen = list(model.versions.values()) if version is None else [model.version(version)]
    return {"model_stats": [served.statistics.as_dict(served.model, served.version) for served in chosen]}


def index_entry(served: ServedVersion) -> dict[str, Any]:
    """A version in the repository's index: its state in Triton's words, and why when it is not ready."""
    state, reason = served.state
    triton_state = STATES[state]
    if state is VersionState.READY and served.draining:
        triton_state = "UNLOADING"  # its turn in the memory budget is over: unloaded once its requests are
    if state is VersionState.UNLOADED:
        reason = "unloaded"
    return {"name": served.model, "version": served.version, "state": triton_state, "reason": reason or ""}


def repository_index(gateway: Gateway, ready_only: bool) -> list[dict[str, Any]]:
    """Every version the gateway serves (``ready_only``: those ready), model by model."""
    entries = [index_entry(served) for served in gateway.models.versions()]
    return [entry for entry in entries if entry["state"] == "READY"] if ready_only else entries


def serving(gateway: Gateway) -> bool:
    """Ready for inference (``/v2/health/ready``, ``ServerReady``): a model can answer and the
    gateway is not shutting down (the broker and the idempotency stream, which /readyz also
    weighs, are not on this path)."""
    return not gateway.closing and any(model.problem is None for model in gateway.models.models.values())


@dataclass(frozen=True)
class OutputTensor:
    """``PROBABILITIES`` of an answer, for either protocol: score rows as FP32, or ranked classes
    (the classification extension) as BYTES ``score:index:label``, best first. Its binary form
    (``raw``) and its JSON values are made only when asked for."""

    datatype: str
    shape: list[int]
    _rows: np.ndarray | list[str]

    @classmethod
    def of(cls, rows: list[np.ndarray] | list[Classification]) -> OutputTensor:
        if rows and all(isinstance(row, Classification) for row in rows):
            ranked = cast(list[Classification], rows)
            strings = [f"{score:f}:{index}:{label}" for row in ranked for index, label, score in row.labels]
            return cls("BYTES", [len(ranked), len(ranked[0].labels)], strings)
        scores = np.stack(cast(list[np.ndarray], rows))
        return cls("FP32", list(scores.shape), scores)

    def raw(self) -> bytes:
        """The protocol's binary form: FP32 little-endian, or each BYTES element after its 4-byte length."""
        if isinstance(self._rows, np.ndarray):
            return self._rows.astype("<f4", copy=False).tobytes()
        return b"".join(struct.pack("<I", len(e)) + e for e in (s.encode() for s in self._rows))

    def values(self) -> list[Any]:
        """The JSON form: the strings, or the scores flattened."""
        return self._rows if isinstance(self._rows, list) else self._rows.ravel().tolist()
