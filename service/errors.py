"""One error base carrying the HTTP status; a subclass per failure the gateway reports.

Third-party exceptions are converted to these at the adapter edge (``raise ... from``), and one
handler in the app renders every one as ``{"error": ..., "detail": ...}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

from service.logs import REQUEST_ID


class GatewayError(Exception):
    status_code = 500
    error = "internal_error"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}


class BadImage(GatewayError):
    """The bytes are empty, truncated, or not an image."""

    status_code = 400
    error = "bad_image"


class BadRequest(GatewayError):
    status_code = 400
    error = "bad_request"


class Unauthorized(GatewayError):
    """Missing or wrong API key (which of the two is deliberately not said)."""

    status_code = 401
    error = "unauthorized"


class RequestTimeout(GatewayError):
    """The client did not send its request body in time."""

    status_code = 408
    error = "request_timeout"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Connection": "close"})


class NotFound(GatewayError):
    status_code = 404
    error = "not_found"


class InvalidParameters(GatewayError):
    status_code = 422
    error = "invalid_parameters"


class PayloadTooLarge(GatewayError):
    """The request body, or an image's pixel count, is over its limit."""

    status_code = 413
    error = "payload_too_large"


class HeadersTooLarge(GatewayError):
    """A request's URL and headers, or a chunked body's trailers, are over their bound in bytes
    or fields (``service.http.protocol``)."""

    status_code = 431
    error = "headers_too_large"


class UrlNotAllowed(GatewayError):
    """An image URL the SSRF guard refuses: a scheme not allowed, or an address that is private,
    loopback, link-local or otherwise not public (``service.ssrf``)."""

    status_code = 403
    error = "url_not_allowed"


class UrlFetchFailed(GatewayError):
    """An image URL that could not be fetched: no connection, an answer other than 200, too many
    redirects, or no complete answer in time."""

    status_code = 400
    error = "url_fetch_failed"


class UnsupportedMediaType(GatewayError):
    status_code = 415
    error = "unsupported_media_type"


class QueueFull(GatewayError):
    status_code = 429
    error = "queue_full"

    def __init__(self, detail: str, *, retry_after: int = 1) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class DeadlineUnmeetable(QueueFull):
    """The adaptive batcher predicts, from the queue ahead and the batch times it has learned, that
    the request would pass its deadline: refused at once (429, like a full queue: retrying once
    the queue has drained can succeed) instead of timing out later."""

    error = "deadline_unmeetable"


class QuotaExceeded(QueueFull):
    """The request's API key is over its rate or its concurrency limit (``service.http.quotas``): 429
    for that key only, while other keys are served."""

    error = "quota_exceeded"


class BackendError(GatewayError):
    """The backend failed while running a batch."""

    status_code = 500
    error = "backend_error"


class BackendUnavailable(GatewayError):
    """The backend is not ready, or the gateway is shutting down."""

    status_code = 503
    error = "backend_unavailable"


class DeadlineExceeded(GatewayError):
    status_code = 504
    error = "deadline_exceeded"


def public_text(exc: BaseException) -> str:
    """What of an exception a client may read: a ``GatewayError``'s detail (written for clients:
    it names no internal identifier), or only the type of any other exception, whose text may name a
    path, an address, a queue or a shared-memory region (that text goes to the log, at warning)."""
    return exc.detail if isinstance(exc, GatewayError) else type(exc).__name__


def printable(text: str) -> str:
    """``text`` as valid Unicode: a detail may quote bytes a client sent (a Location header, a
    filename) that were decoded with ``surrogateescape``; a lone surrogate cannot be encoded as
    UTF-8, so rendering it would turn a 400 into a 500. Such bytes are shown as ``\\udcff``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(error: str, detail: str, request_id: str | None = None) -> dict[str, Any]:
    """The one JSON shape of every error the gateway answers: the code, what was wrong, and the
    request's id (also in the ``X-Request-ID`` header and on its log lines; by default the one of
    the request being handled)."""
    body: dict[str, Any] = {"error": error, "detail": printable(detail)}
    request_id = request_id or REQUEST_ID.get()
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(exc: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status_code, headers=exc.headers)


def protocol_error(exc: GatewayError) -> JSONResponse:
    """The Open Inference Protocol's error shape (``{"error": "<message>"}``, what its clients
    show), with the gateway's status code and headers (Retry-After...)."""
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def error_response_for(path: str) -> Callable[[GatewayError], JSONResponse]:
    """How a refusal on ``path`` is rendered: in the protocol's shape under ``/v2``, where
    ``tritonclient`` reads ``error`` as the message, else in the gateway's own."""
    return protocol_error if path == "/v2" or path.startswith("/v2/") else error_response


def validation_detail(errors: Sequence[Mapping[str, Any]]) -> str:
    """Pydantic's errors as one line, ``where: what; ...`` (the request part a location starts with,
    query or body, left out)."""
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "body", "path", "header"))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


class ModelNotLoaded(BackendUnavailable):
    """A model version could not be loaded in time, or not at all now (its memory is held by
    models in use): retry after a moment."""

    error = "model_not_loaded"

    def __init__(self, detail: str, *, retry_after: int = 1) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after)})


class Forbidden(GatewayError):
    """The request needs a key it did not send (the admin key of the models' load and unload)."""

    status_code = 403
    error = "forbidden"


class Conflict(GatewayError):
    """The request cannot be done in the resource's present state (a model in use, loaded at start)."""

    status_code = 409
    error = "conflict"
