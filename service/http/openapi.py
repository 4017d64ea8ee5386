"""The OpenAPI description of what ``POST /classify`` takes and how it refuses: the request bodies
(multipart, an image body, JSON of URLs) and every error status with its meaning."""

from __future__ import annotations

from typing import Any

from service.images.files import MEDIA_TYPES
from service.schemas import ErrorBody, UrlImage, UrlImages

_BINARY = {"type": "string", "format": "binary"}


def _url_images_schema() -> dict[str, Any]:
    """UrlImages' JSON schema with its item schema inlined (OpenAPI resolves no nested ``$defs``)."""
    schema = UrlImages.model_json_schema()
    schema.pop("$defs", None)
    schema["properties"]["images"]["items"] = UrlImage.model_json_schema()
    return schema


CLASSIFY_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"file": {"type": "array", "items": _BINARY, "description": "One part per image."}},
                "required": ["file"],
            }
        },
        **{t: {"schema": _BINARY} for t in (*MEDIA_TYPES, "application/octet-stream")},
        "application/json": {"schema": _url_images_schema()},
    },
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "Empty, truncated or undecodable image, a malformed multipart or JSON body, or an image URL that "
        "could not be fetched (`url_fetch_failed`: no connection, not 200, too many redirects, too slow).",
        403: "An image URL or a Webhook-URL the SSRF guard refuses (`url_not_allowed`): a private, loopback, "
        "link-local or metadata address not allow-listed, or http where only https is allowed.",
        401: "API keys are configured and the request carries no valid one (`Authorization: Bearer` or `X-API-Key`).",
        408: "The request body did not arrive within GATEWAY_BODY_TIMEOUT.",
        413: "Body, image count or an image's decoded size over its limit, or more images than the API key's "
        "burst allows at once.",
        415: "Content type that is not an image, multipart/form-data or JSON, or an image URL whose answer is "
        "not an image type.",
        404: "Unknown job, or another API key's (GET /jobs/{job_id}).",
        409: "mode=offline: the Idempotency-Key was used before with a different body (`idempotency_conflict`).",
        422: "Invalid query parameters.",
        429: "Retry after `Retry-After` seconds: the batch queue is full (`queue_full`), the request cannot meet "
        "its deadline (`deadline_unmeetable`), or the API key is over its rate or concurrency quota "
        "(`quota_exceeded`; other keys are still served).",
        500: "The backend failed on the batch.",
        503: "The backend is not ready, or the gateway is shutting down.",
        504: "The request deadline passed.",
    }.items()
}
ERRORS[429]["headers"] = {
    "Retry-After": {"description": "Seconds after which a retry may succeed.", "schema": {"type": "integer"}}
}


# --- the Open Inference Protocol (KServe v2) -------------------------------------------------------

V2_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
"""The protocol's error shape, ``{"error": "<message>"}``."""

V2_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"schema": V2_ERROR}}}
    for code, text in {
        400: "A malformed or invalid inference request (its JSON header, shapes, datatypes, an image that "
        "cannot be decoded).",
        401: "API keys are configured and the request carries no valid one.",
        403: "An admin route without the admin key.",
        404: "A model or version the gateway does not serve, or an output the model does not have.",
        405: "A method the route does not take.",
        408: "The request body did not arrive within GATEWAY_BODY_TIMEOUT.",
        413: "A body or an image over its limit.",
        415: "A body that is neither JSON nor the binary extension's.",
        422: "A query parameter the route does not take (the message lists those it does).",
        429: "Retry after `Retry-After` seconds: the model's queue is full, or the API key is over its quota.",
        500: "The backend failed on the batch.",
        503: "The model, or the gateway, is not ready.",
        504: "The request deadline passed.",
    }.items()
}
V2_ERRORS[429]["headers"] = ERRORS[429]["headers"]


def v2_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The protocol's errors a route can answer (every route but the health ones also 401 and 405)."""
    return {code: V2_ERRORS[code] for code in sorted({401, 405, *codes})}


def v2_readiness(*fields: str) -> dict[int | str, dict[str, Any]]:
    """A readiness route's answers: 200 ready, 503 not, with the same body (``fields`` and ``ready``)."""
    properties: dict[str, Any] = {name: {"type": "string"} for name in fields}
    schema = {
        "type": "object",
        "properties": {**properties, "ready": {"type": "boolean"}},
        "required": [*fields, "ready"],
    }
    body = {"content": {"application/json": {"schema": schema}}}
    return {200: {"description": "Ready.", **body}, 503: {"description": "Not ready.", **body}}


INFERENCE_HEADER = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "description": "The binary tensor data extension: the body is this many bytes of the JSON request, then "
    "each input's raw bytes (an input's `parameters.binary_data_size` says how many).",
    "schema": {"type": "integer", "minimum": 0},
}

_INPUT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "The model's input, as its metadata names it (`IMAGE`)."},
        "datatype": {"type": "string", "enum": ["BYTES"], "description": "Each element one encoded image."},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 2},
        "data": {
            "type": "array",
            "items": {"type": "string", "description": "An image file, base64-encoded."},
            "description": "Omitted with the binary extension (`parameters.binary_data_size`).",
        },
        "parameters": {
            "type": "object",
            "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
        },
    },
    "required": ["name", "datatype", "shape"],
}
_OUTPUT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "An output of the model's metadata (`PROBABILITIES`)."},
        "parameters": {
            "type": "object",
            "properties": {
                "classification": {
                    "type": "integer",
                    "minimum": 1,
                    "description": "The top classes, as `score:index:label` strings.",
                },
                "binary_data": {"type": "boolean"},
            },
        },
    },
    "required": ["name"],
}
V2_INFER_BODY: dict[str, Any] = {
    "required": True,
    "description": "An inference request: `inputs` (one `IMAGE` tensor of encoded images), optionally "
    "`outputs` (`PROBABILITIES`, with `parameters.classification` for the top classes as "
    "`score:index:label`). Or the binary extension: `Inference-Header-Content-Length` bytes of this JSON, "
    "then the tensors' raw bytes.",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "id": {"type": "string"},
                    "inputs": {"type": "array", "items": _INPUT, "minItems": 1, "maxItems": 1},
                    "outputs": {"type": "array", "items": _OUTPUT},
                    "parameters": {"type": "object"},
                },
                "required": ["inputs"],
            }
        },
        "application/octet-stream": {"schema": _BINARY},
    },
}
