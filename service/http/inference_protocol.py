"""The Open Inference Protocol (KServe v2) over REST, on the gateway's port: what Triton, MLServer
and KServe speak, so their clients (``tritonclient.http``, the KServe SDK) work here as they are.

* ``GET /v2`` (server metadata), ``GET /v2/health/live``, ``GET /v2/health/ready``;
* ``GET /v2/models/{name}[/versions/{version}]`` (metadata) and ``.../ready``;
* ``POST /v2/models/{name}[/versions/{version}]/infer``.

The model takes encoded images, not pixels: one input, ``IMAGE``, a ``BYTES`` tensor of shape
``[N]`` or ``[N, 1]``, each element one encoded image (JPEG, PNG, WebP...). Its elements travel in
the binary tensor data extension (``Inference-Header-Content-Length``, ``binary_data_size``; each
element a 4-byte little-endian length and its bytes), which ``tritonclient`` uses by default, so
photos go as raw bytes; or in JSON, each element the base64 of the image (JSON has no bytes).
The output, ``PROBABILITIES``, is the model's own tensor, ``FP32 [N, outputs]``: the scores of its
classes, or for a model that gives embeddings its vectors (same name, so a client reads any model
the same way; the metadata's ``output`` parameter says which). With the classification extension
(``"parameters": {"classification": k}`` on the requested output) it is ``BYTES [N, k]``, each
element ``"score:index:label"``, best first: the k best of a sigmoid model too, whatever their
score (a tensor's rows are all k long; the scores are in the elements); asked of an embedding model,
a 400. Outputs are JSON unless asked for in binary (``binary_data`` on an output, or
``binary_data_output`` on the request).

Underneath is ``/classify``'s path: the same decode pool, batcher, backend, admission, quotas,
deadline and error status codes; errors have the protocol's shape, ``{"error": "<message>"}``.
"""

from __future__ import annotations

import json
import struct
from typing import Any, cast

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service import __version__
from service.classifier import Classification
from service.errors import GatewayError
from service.http.gateway import CANCEL_ON_DISCONNECT, choose, gateway_of, key_of, online, reject_unknown_query
from service.http.inference_request import HEADER_LENGTH, INPUT, OUTPUT, read_request
from service.serving.served import ServedModel, ServedVersion

EXTENSIONS = ["classification", "binary_tensor_data"]

router = APIRouter(include_in_schema=False)  # specified by the protocol, documented in docs/models.md


def protocol_error(exc: GatewayError) -> JSONResponse:
    """The protocol's error shape, with the gateway's status code and headers (Retry-After...)."""
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _model(request: Request, name: str) -> ServedModel:
    return gateway_of(request).models.get(name)


def _version(request: Request, name: str, version: str | None) -> ServedVersion:
    """The named version, or (none named) the one the model's traffic weights pick for this request."""
    gateway = gateway_of(request)
    return choose(gateway, key_of(request), name, version)


def _serving(request: Request) -> bool:
    """Ready for inference: a model can answer and the gateway is not shutting down (the broker and
    the idempotency stream, which /readyz also weighs, are not on this path)."""
    gateway = gateway_of(request)
    models = gateway.models.models.values()
    return not gateway.closing and any(model.problem is None for model in models)


@router.get("/v2")
async def server_metadata() -> dict[str, Any]:
    return {"name": "inference-gateway", "version": __version__, "extensions": EXTENSIONS}


@router.get("/v2/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/v2/health/ready")
async def ready(request: Request) -> JSONResponse:
    is_ready = _serving(request)
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    try:
        model = _model(request, name)
        versions = list(model.versions.values()) if version is None else [model.version(version)]
    except GatewayError as exc:
        return protocol_error(exc)
    first = versions[0]  # a model's versions may differ in backend, not in what they take and give
    profile = first.spec.profile
    return JSONResponse(
        {
            "name": model.name,
            "versions": [served.version for served in versions],
            "platform": f"inference-gateway/{first.backend_name}",
            "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, profile.outputs]}],
            "parameters": {
                "image_size": profile.height,
                "input_size": [profile.height, profile.width],
                "output": profile.output,
                "max_images_per_request": gateway_of(request).settings.max_images_per_request,
            },
        }
    )


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    """A model is ready when a version taking traffic is; a version when its backend is."""
    try:
        model = _model(request, name)
        problem = model.problem if version is None else model.version(version).problem
    except GatewayError as exc:
        return protocol_error(exc)
    is_ready = problem is None and not gateway_of(request).closing
    return JSONResponse({"name": name, "ready": is_ready}, status_code=200 if is_ready else 503)


@router.post("/v2/models/{name}/infer")
async def infer(request: Request, name: str) -> Response:
    """Documents the route (its template names it in metrics); ``ClassifyFastPath`` serves it with
    ``handle_infer``, as it serves ``/classify``. A route of its own, not ``infer_version``'s with
    a default: FastAPI would take ``version`` as a query parameter here, which the fast path (the
    version from the path only) would accept and ignore, answering from another version."""
    return await infer_version(request, name, None)


@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer_version(request: Request, name: str, version: str | None) -> Response:
    """The same, for a version named in the path."""
    try:
        return await handle_infer(request, name, version)
    except GatewayError as exc:
        return protocol_error(exc)


async def handle_infer(request: Request, name: str, version: str | None = None) -> Response:
    """An inference request for a model (and a version, or one picked by its traffic weights),
    online on ``/classify``'s path; cancelled when its client leaves (``CANCEL_ON_DISCONNECT``)."""
    request.scope[CANCEL_ON_DISCONNECT] = True
    await reject_unknown_query(request)
    served = _version(request, name, version)
    gateway = gateway_of(request)
    gateway.models.check(served)  # full now: refuse before reading the body
    body = await request.body()
    asked = await read_request(
        body,
        request.headers.get(HEADER_LENGTH),
        gateway.settings.max_images_per_request,
        served.spec.profile.outputs,
    )
    rows = await online(gateway, key_of(request), served, asked.images, asked.k)
    return _answer(asked.id, served, rows, asked.binary_output)


def _answer(
    request_id: str | None, served: ServedVersion, rows: list[np.ndarray] | list[Classification], binary: bool
) -> Response:
    """``PROBABILITIES`` from score rows (FP32), or from ranked classes (classification: BYTES
    ``score:index:label``, ranked by the batcher as ``/classify``'s answers are), JSON or binary."""
    tensor: dict[str, Any]
    if all(isinstance(row, Classification) for row in rows):
        ranked = cast(list[Classification], rows)
        strings = [f"{score:f}:{index}:{label}" for row in ranked for index, label, score in row.labels]
        tensor = {"name": OUTPUT, "datatype": "BYTES", "shape": [len(ranked), len(ranked[0].labels)]}
        raw = b"".join(struct.pack("<I", len(e)) + e for e in (s.encode() for s in strings))
        values: list[Any] = strings
    else:
        scores = np.stack(cast(list[np.ndarray], rows))
        tensor = {"name": OUTPUT, "datatype": "FP32", "shape": list(scores.shape)}
        raw = scores.astype("<f4", copy=False).tobytes()
        values = scores.ravel().tolist()
    answer: dict[str, Any] = {"model_name": served.model, "model_version": served.version, "outputs": [tensor]}
    if request_id is not None:
        answer["id"] = request_id
    if not binary:
        tensor["data"] = values
        return JSONResponse(answer)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(answer, separators=(",", ":")).encode()
    return Response(head + raw, media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))})
