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
The output, ``PROBABILITIES``, is ``FP32 [N, classes]``; with the classification extension
(``"parameters": {"classification": k}`` on the requested output) it is ``BYTES [N, k]``, each
element ``"score:index:label"``, best first. Outputs are JSON unless asked for in binary
(``binary_data`` on an output, or ``binary_data_output`` on the request).

Underneath is ``/classify``'s path: the same decode pool, batcher, backend, admission, quotas,
deadline and error status codes; errors have the protocol's shape, ``{"error": "<message>"}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from typing import Any, cast

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from service import __version__
from service.classifier import Classification, ImageInput
from service.errors import BadRequest, GatewayError
from service.http.api import choose, gateway_of, online, reject_unknown_query
from service.serving.served import ServedModel, ServedVersion

INPUT = "IMAGE"
OUTPUT = "PROBABILITIES"
HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["classification", "binary_tensor_data"]

router = APIRouter(include_in_schema=False)  # specified by the protocol, documented in docs/models.md


def protocol_error(exc: GatewayError) -> JSONResponse:
    """The protocol's error shape, with the gateway's status code and headers (Retry-After...)."""
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _model(request: Request, name: str) -> ServedModel:
    return gateway_of(request).models.get(name)


def _version(request: Request, name: str, version: str | None) -> ServedVersion:
    """The named version, or (none named) the one the model's traffic weights pick for this request."""
    return choose(request, gateway_of(request), name, version)


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
    return JSONResponse(
        {
            "name": model.name,
            "versions": [served.version for served in versions],
            "platform": f"inference-gateway/{first.backend_name}",
            "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, len(first.spec.profile.labels)]}],
            "parameters": {
                "image_size": first.spec.profile.image_size,
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
@router.post("/v2/models/{name}/versions/{version}/infer")
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    try:
        await reject_unknown_query(request)
        served = _version(request, name, version)
        body = await request.body()
        header, binary = _split(body, request.headers.get(HEADER_LENGTH))
        images = _images(header, binary, gateway_of(request).settings.max_images_per_request)
        k, binary_output = _requested(header, len(served.spec.profile.labels))
        return _answer(header, served, await online(request, served, images, k), binary_output)
    except GatewayError as exc:
        return protocol_error(exc)


def _split(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON header and what follows it (the binary tensor data)."""
    if header_length is None:
        length = len(body)
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be a number of bytes within the body ({len(body)})")
        length = int(header_length)
    try:
        header = json.loads(body[:length])
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the inference request's header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadRequest("the inference request must be a JSON object")
    return header, memoryview(body)[length:]


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return value


def _images(header: dict[str, Any], binary: memoryview, most: int) -> list[ImageInput]:
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadRequest(f"inputs must hold one tensor, {INPUT!r} (BYTES, shape [N] or [N,1])")
    tensor = inputs[0]
    if tensor.get("name") != INPUT:
        raise BadRequest(f"unknown input {tensor.get('name')!r}; this model takes {INPUT!r}")
    if tensor.get("datatype") != "BYTES":
        raise BadRequest(f"input {INPUT!r} must be BYTES (each element one encoded image)")
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) not in (1, 2)
        or not all(type(d) is int for d in shape)
        or (len(shape) == 2 and shape[1] != 1)
    ):
        raise BadRequest(f"input {INPUT!r} must have shape [N] or [N,1]; got {shape!r}")
    count = shape[0]
    if not 1 <= count <= most:
        raise BadRequest(f"input {INPUT!r} holds {count} images; 1 to {most} per request")
    parameters = _object(tensor.get("parameters"), f"input {INPUT!r}'s parameters")
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size != len(binary):
            raise BadRequest(
                f"binary_data_size ({size!r}) must be the {len(binary)} bytes after the header (one input)"
            )
        if "data" in tensor:
            raise BadRequest(f"input {INPUT!r} has both data and binary_data_size")
        elements = _bytes_elements(binary)
    else:
        if len(binary):
            raise BadRequest("bytes after the JSON header, but no input gives a binary_data_size")
        elements = _base64_elements(tensor.get("data"))
    if len(elements) != count:
        raise BadRequest(f"input {INPUT!r} has shape {shape} but holds {len(elements)} elements")
    return [ImageInput(data, f"{INPUT}[{i}]") for i, data in enumerate(elements)]


def _bytes_elements(binary: memoryview) -> list[bytes]:
    """The protocol's BYTES serialization: each element a 4-byte little-endian length, then it."""
    elements, at = [], 0
    while at < len(binary):
        if at + 4 > len(binary):
            raise BadRequest("the binary tensor data ends inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", binary, at)
        at += 4
        if at + length > len(binary):
            raise BadRequest(f"a binary tensor element says {length} bytes; {len(binary) - at} are left")
        elements.append(bytes(binary[at : at + length]))
        at += length
    return elements


def _base64_elements(data: Any) -> list[bytes]:
    flat = data
    if isinstance(flat, list) and flat and all(isinstance(row, list) for row in flat):
        flat = [element for row in flat for element in row]  # [[...], [...]] for shape [N,1]
    if not isinstance(flat, list) or not all(isinstance(element, str) for element in flat):
        raise BadRequest(f"input {INPUT!r}: data must be a list of base64 strings (one image each)")
    try:
        return [base64.b64decode(element, validate=True) for element in flat]
    except (binascii.Error, ValueError):
        raise BadRequest(f"input {INPUT!r}: an element of data is not base64") from None


def _requested(header: dict[str, Any], classes: int) -> tuple[int | None, bool]:
    """What the request asks of the output: classification's k (None: probabilities), binary."""
    parameters = _object(header.get("parameters"), "the request's parameters")
    binary = parameters.get("binary_data_output", False) is True
    outputs = header.get("outputs")
    if outputs is None:
        return None, binary
    if not isinstance(outputs, list) or len(outputs) != 1 or not isinstance(outputs[0], dict):
        raise BadRequest(f"outputs must name one tensor, {OUTPUT!r}")
    if outputs[0].get("name") != OUTPUT:
        raise BadRequest(f"unknown output {outputs[0].get('name')!r}; this model gives {OUTPUT!r}")
    wanted = _object(outputs[0].get("parameters"), f"output {OUTPUT!r}'s parameters")
    binary = wanted.get("binary_data", binary) is True
    k = wanted.get("classification")
    if k is None:
        return None, binary
    if type(k) is not int or not 1 <= k <= classes:
        raise BadRequest(f"classification must be a whole number of classes from 1 to {classes}; got {k!r}")
    return k, binary


def _answer(
    header: dict[str, Any], served: ServedVersion, rows: list[np.ndarray] | list[Classification], binary: bool
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
    if isinstance(header.get("id"), str):
        answer["id"] = header["id"]
    if not binary:
        tensor["data"] = values
        return JSONResponse(answer)
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(answer, separators=(",", ":")).encode()
    return Response(head + raw, media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))})
