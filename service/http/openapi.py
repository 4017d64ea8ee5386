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
