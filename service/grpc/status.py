"""The gateway's errors as gRPC status codes: each HTTP status the REST fronts answer maps to the
code a gRPC client expects for it, and the message is the same sentence."""

from __future__ import annotations

import grpc

from service.errors import GatewayError

CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_of(exc: GatewayError) -> grpc.StatusCode:
    """The gRPC code for ``exc``'s HTTP status (INTERNAL for one without a mapping)."""
    return CODES.get(exc.status_code, grpc.StatusCode.INTERNAL)


def trailers_of(exc: GatewayError) -> tuple[tuple[str, str], ...]:
    """What the error says besides its message: its code (``gateway-error``: ``queue_full``...) and,
    for a refusal that will pass later, ``retry-after`` in seconds, as the HTTP answer's header."""
    trailers = [("gateway-error", exc.error)]
    retry = exc.headers.get("Retry-After")
    if retry is not None:
        trailers.append(("retry-after", retry))
    return tuple(trailers)
