"""The Open Inference Protocol (KServe v2) over REST, on the gateway's port: what Triton, MLServer
and KServe speak, so their clients (``tritonclient.http``, the KServe SDK) work here as they are.

* ``GET /v2`` (server metadata), ``GET /v2/health/live``, ``GET /v2/health/ready``;
* ``GET /v2/models/{name}[/versions/{version}]`` (metadata) and ``.../ready``;
* ``POST /v2/models/{name}[/versions/{version}]/infer``;
* ``GET /v2/models/{name}[/versions/{version}]/config`` (model configuration extension);
* ``GET /v2/models[/{name}[/versions/{version}]]/stats`` (statistics extension);
* ``POST /v2/repository/index`` and ``POST /v2/repository/models/{name}/load|unload`` (model
  repository extension; load and unload behind the admin key, ``X-Admin-Key``).

What the protocol defines and the gateway does not serve (shared memory, trace and log settings),
and any other path under ``/v2`` or method of these, answers in the protocol's error shape (400,
404 or 405), never a bare 404 page. The answers' shapes come from ``service.http.inference_shapes``,
which the gRPC front shares.

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
import re
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match

from service.classifier import Classification
from service.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge
from service.errors import protocol_error as protocol_error
from service.http import inference_shapes, strict_json
from service.http.gateway import (
    CANCEL_ON_DISCONNECT,
    CHECKED_QUERY,
    RESERVED,
    choose,
    gateway_of,
    key_of,
    online,
    reject_unknown_query,
)
from service.http.inference_request import HEADER_LENGTH, OUTPUT, read_request
from service.http.json_body import read_within
from service.http.model_routes import check_admin, set_loaded
from service.http.openapi import INFERENCE_HEADER, V2_ERRORS, V2_INFER_BODY, v2_errors, v2_readiness
from service.serving.served import ServedModel, ServedVersion, quoted

router = APIRouter(tags=["Open Inference Protocol (KServe v2)"])
"""Specified by the protocol, documented in docs/api.md; in /openapi.json with the protocol's error shape,
each route with the errors it can answer."""
REPOSITORY_ERRORS = v2_errors(400, 403, 404, 413, 422, 500, 503)
MODEL_READINESS = {**v2_errors(404), **v2_readiness("name")}
INFER_ERRORS = V2_ERRORS  # every one of the protocol's errors
INFER_EXTRA = {"requestBody": V2_INFER_BODY, "parameters": [INFERENCE_HEADER]}

REPOSITORY_BODY_BYTES = 16 * 1024
"""Largest body of a repository request (``{"ready": true}``, an unload's ``unload_dependents``):
the gateway takes no configuration or files with a load, so this is room enough."""
REPOSITORY_BODY_VALUES = 64
"""JSON values a repository request's body may hold, counted before it is parsed."""
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class MethodNotAllowed(GatewayError):
    """A path of the protocol asked with a method it does not take."""

    status_code = 405
    error = "method_not_allowed"


def _model(request: Request, name: str) -> ServedModel:
    return gateway_of(request).models.get(name)


def _version(request: Request, name: str, version: str | None) -> ServedVersion:
    """The named version, or (none named) the one the model's traffic weights pick for this request."""
    gateway = gateway_of(request)
    return choose(gateway, key_of(request), name, version)


@router.get("/v2", responses=v2_errors())
async def server_metadata() -> dict[str, Any]:
    return inference_shapes.server_metadata()


@router.get("/v2/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/v2/health/ready", responses=v2_readiness())
async def ready(request: Request) -> JSONResponse:
    is_ready = inference_shapes.serving(gateway_of(request))
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/v2/models/stats", dependencies=CHECKED_QUERY, responses=v2_errors(400, 422))
async def all_statistics(request: Request) -> Response:
    """Every version's statistics. Before ``/v2/models/{name}``, which would take ``stats`` for a name."""
    return JSONResponse(inference_shapes.model_statistics(gateway_of(request), None, None))


@router.get("/v2/models/{name}", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422))
@router.get("/v2/models/{name}/versions/{version}", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422))
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    try:
        model = _model(request, name)
        versions = list(model.versions.values()) if version is None else [model.version(version)]
    except GatewayError as exc:
        return protocol_error(exc)
    return JSONResponse(inference_shapes.model_metadata(gateway_of(request), model, versions))


@router.get("/v2/models/{name}/config", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422))
@router.get(
    "/v2/models/{name}/versions/{version}/config", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422)
)
async def model_config(request: Request, name: str, version: str | None = None) -> Response:
    """The version's configuration (without one, the model's first version: its versions may
    differ in backend and batching, not in what they take and give)."""
    try:
        model = _model(request, name)
        served = next(iter(model.versions.values())) if version is None else model.version(version)
    except GatewayError as exc:
        return protocol_error(exc)
    return JSONResponse(inference_shapes.model_config(gateway_of(request), served))


@router.get("/v2/models/{name}/stats", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422))
@router.get(
    "/v2/models/{name}/versions/{version}/stats", dependencies=CHECKED_QUERY, responses=v2_errors(400, 404, 422)
)
async def model_statistics(request: Request, name: str, version: str | None = None) -> Response:
    try:
        return JSONResponse(inference_shapes.model_statistics(gateway_of(request), name, version))
    except GatewayError as exc:
        return protocol_error(exc)


@router.post("/v2/repository/index", dependencies=CHECKED_QUERY, responses=v2_errors(400, 403, 413, 422))
async def repository_index(request: Request) -> Response:
    """Every version and its state; with ``{"ready": true}``, those ready. ``tritonclient`` sends no body."""
    try:
        body = await _repository_body(request, "repository index request")
        ready_only = body.pop("ready", False)
        if not isinstance(ready_only, bool):
            raise BadRequest(f"repository index request: ready must be true or false, not {_kind(ready_only)}")
        _no_other_keys(body, "repository index request", "ready")
    except GatewayError as exc:
        return protocol_error(exc)
    return JSONResponse(inference_shapes.repository_index(gateway_of(request), ready_only))


@router.post("/v2/repository/models/{name}/load", dependencies=CHECKED_QUERY, responses=REPOSITORY_ERRORS)
async def repository_load(request: Request, name: str) -> Response:
    """Load every version of a model (admin key): what ``POST /v1/models/{name}/load`` does.
    Triton's load may bring a configuration or files; the gateway loads what its models file
    declares, so those are refused."""
    return await _control(request, name, load=True)


@router.post("/v2/repository/models/{name}/unload", dependencies=CHECKED_QUERY, responses=REPOSITORY_ERRORS)
async def repository_unload(request: Request, name: str) -> Response:
    """Unload every version of a model (admin key); ``unload_dependents`` is taken and changes
    nothing (the gateway has no ensembles)."""
    return await _control(request, name, load=False)


async def _control(request: Request, name: str, load: bool) -> Response:
    """The admin key first (nothing of the body is said to a caller without it), then the body,
    then the load or unload. Triton answers an empty 200."""
    what = f"repository {'load' if load else 'unload'} request"
    try:
        check_admin(request)
        body = await _repository_body(request, what)
        parameters = body.pop("parameters", {})
        _no_other_keys(body, what, "parameters")
        if not isinstance(parameters, dict):
            raise BadRequest(f"{what}: parameters must be an object, not {_kind(parameters)}")
        if load:
            if parameters:
                shown = ", ".join(quoted(key, 64, "key") for key in list(parameters)[:5])
                raise BadRequest(
                    f"{what}: parameters ({shown}) are not supported: the gateway loads a model as its models "
                    "file declares it, without a configuration or files sent with the load"
                )
        else:
            dependents = parameters.pop("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise BadRequest(f"{what}: unload_dependents must be true or false, not {_kind(dependents)}")
            _no_other_keys(parameters, f"{what}'s parameters", "unload_dependents")
        await set_loaded(gateway_of(request), name, load)
    except GatewayError as exc:
        return protocol_error(exc)
    return Response(status_code=200)


async def _repository_body(request: Request, what: str) -> dict[str, Any]:
    """A repository request's JSON object ({} for an empty body), read within
    ``REPOSITORY_BODY_BYTES`` and ``REPOSITORY_BODY_VALUES`` before it is parsed, strictly."""
    too_large = PayloadTooLarge(f"{what}: a body over {REPOSITORY_BODY_BYTES} bytes")
    data = await read_within(request, REPOSITORY_BODY_BYTES, too_large)
    if not data.strip():
        return {}
    if not strict_json.values_at_most(data, REPOSITORY_BODY_VALUES):
        raise BadRequest(f"{what}: holds over {REPOSITORY_BODY_VALUES} JSON values")
    value = strict_json.loads(strict_json.utf8(data, what), what)
    if not isinstance(value, dict):
        raise BadRequest(f"{what}: must be a JSON object, not {_kind(value)}")
    return value


def _no_other_keys(body: dict[str, Any], what: str, known: str) -> None:
    if body:
        shown = ", ".join(quoted(key, 64, "key") for key in list(body)[:5])
        raise BadRequest(f"{what}: unknown key(s) {shown}; it takes {known}")


def _kind(value: Any) -> str:
    """A JSON value's kind, for an error (never the value: it may be large)."""
    kinds = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return kinds.get(type(value), "null")


@router.get("/v2/models/{name}/ready", responses=MODEL_READINESS)
@router.get("/v2/models/{name}/versions/{version}/ready", responses=MODEL_READINESS)
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    """A model is ready when a version taking traffic is; a version when its backend is."""
    try:
        model = _model(request, name)
        problem = model.problem if version is None else model.version(version).problem
    except GatewayError as exc:
        return protocol_error(exc)
    is_ready = problem is None and not gateway_of(request).closing
    return JSONResponse({"name": name, "ready": is_ready}, status_code=200 if is_ready else 503)


@router.post("/v2/models/{name}/infer", openapi_extra=INFER_EXTRA, responses=INFER_ERRORS)
async def infer(request: Request, name: str) -> Response:
    """Documents the route (its template names it in metrics); ``ClassifyFastPath`` serves it with
    ``handle_infer``, as it serves ``/classify``. A route of its own, not ``infer_version``'s with
    a default: FastAPI would take ``version`` as a query parameter here, which the fast path (the
    version from the path only) would accept and ignore, answering from another version."""
    return await infer_version(request, name, None)


@router.post("/v2/models/{name}/versions/{version}/infer", openapi_extra=INFER_EXTRA, responses=INFER_ERRORS)
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
    reserved = request.scope.get(RESERVED)  # admitted from its head
    gateway.models.check(served, reserved)  # full now: refuse before reading the body
    body = await request.body()
    asked = await read_request(
        body,
        request.headers.get(HEADER_LENGTH),
        gateway.settings.max_images_per_request,
        served.spec.profile.outputs,
    )
    rows = await online(gateway, key_of(request), served, asked.images, asked.k, reserved=reserved)
    return _answer(asked.id, served, rows, asked.binary_output)


def _answer(
    request_id: str | None, served: ServedVersion, rows: list[np.ndarray] | list[Classification], binary: bool
) -> Response:
    """``PROBABILITIES`` from score rows (FP32), or from ranked classes (classification: BYTES
    ``score:index:label``, ranked by the batcher as ``/classify``'s answers are), JSON or binary."""
    output = inference_shapes.OutputTensor.of(rows)
    tensor: dict[str, Any] = {"name": OUTPUT, "datatype": output.datatype, "shape": output.shape}
    answer: dict[str, Any] = {"model_name": served.model, "model_version": served.version, "outputs": [tensor]}
    if request_id is not None:
        answer["id"] = request_id
    if not binary:
        tensor["data"] = output.values()
        return JSONResponse(answer)
    raw = output.raw()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(answer, separators=(",", ":")).encode()
    return Response(head + raw, media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))})


UNSUPPORTED: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"/v2/(?:system|cuda)sharedmemory(?:/.*)?"),
        "shared memory (system or CUDA) is not supported by this gateway: send the tensors in the request's "
        "body (the binary tensor data extension)",
    ),
    (
        re.compile(r"/v2(?:/models/[^/]+(?:/versions/[^/]+)?)?/trace/setting"),
        "trace settings are not supported by this gateway (it sends OpenTelemetry traces: GATEWAY_TRACING_ENDPOINT)",
    ),
    (re.compile(r"/v2/logging"), "log settings are not supported by this gateway"),
)
"""Extensions of the protocol the gateway does not serve: a 400 saying so, whatever the method."""


@router.api_route("/v2", methods=METHODS, include_in_schema=False)
@router.api_route("/v2/{rest:path}", methods=METHODS, include_in_schema=False)
async def unsupported(request: Request, rest: str = "") -> Response:
    """Registered last: any other path under ``/v2``, or a method a path of the protocol does not
    take, answers in the protocol's error shape (a 405 with ``Allow`` for the latter), not with
    the framework's 404 page."""
    path, method = request.scope["path"], request.method
    shown = repr(path) if len(path) <= 200 else f"(a path of {len(path)} characters)"
    for pattern, why in UNSUPPORTED:
        if pattern.fullmatch(path):
            return protocol_error(BadRequest(why))
    allowed = sorted({taken for route in router.routes for taken in _methods(route, request)})
    if allowed:
        exc = MethodNotAllowed(f"{method} {shown} is not supported: it takes {', '.join(allowed)}")
        exc.headers["Allow"] = ", ".join(allowed)
        return protocol_error(exc)
    return protocol_error(NotFound(f"{method} {shown} is not supported: no route of the Open Inference Protocol here"))


def _methods(route: BaseRoute, request: Request) -> set[str]:
    """The methods ``route`` takes when its path is ``request``'s (none when it is not, and none of
    ``unsupported``'s own)."""
    if getattr(route, "endpoint", None) is unsupported:
        return set()
    match, _ = route.matches({**request.scope, "method": ""})
    return set(getattr(route, "methods", None) or ()) if match is not Match.NONE else set()
