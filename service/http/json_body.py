"""Reading the JSON body of POST /classify (images by URL) within bounds fixed before parsing.

A JSON body is bounded in bytes before a byte of it is parsed: from Content-Length, then as it
streams in (413). The bound is small (``max_images_per_request`` URLs of at most
``MAX_URL_LENGTH`` characters each, with room for the JSON around them), so the largest body the
parse can meet costs little, and a body over ``INLINE_PARSE_BYTES`` is parsed in a worker thread
rather than on the event loop. The image count is checked on the parsed list before the schema
validates each entry, so a body of many tiny entries never builds an error per entry.

Strict on what JSON leaves open: duplicate keys, NaN and Infinity, invalid UTF-8 and strings
holding a lone UTF-16 surrogate are refused (400), so no other parser of the same body reads it differently.
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from service.errors import BadRequest, PayloadTooLarge, validation_detail
from service.http import strict_json
from service.schemas import MAX_URL_LENGTH, UrlImages

INLINE_PARSE_BYTES = 16 * 1024
"""Bodies up to this size (hundreds of URLs) are parsed on the event loop (~0.1 ms); larger ones
in a worker thread."""
SHOWN_ERRORS = 5
"""Schema errors named in the answer (the rest are counted)."""


async def read_urls(request: Request, max_bytes: int, max_images: int) -> list[str]:
    """The URLs of the request's JSON body, in order; 413 over ``max_bytes``, 400 for anything
    else wrong (naming what)."""
    body = await _read(request, max_bytes)
    if len(body) > INLINE_PARSE_BYTES:
        return await run_in_threadpool(parse_urls, body, max_images)
    return parse_urls(body, max_images)


async def _read(request: Request, max_bytes: int) -> bytes:
    too_large = PayloadTooLarge(
        f"JSON body is over {max_bytes} bytes (GATEWAY_MAX_JSON_BODY_BYTES: room for "
        f"GATEWAY_MAX_IMAGES_PER_REQUEST URLs of up to {MAX_URL_LENGTH} characters)"
    )
    return await read_within(request, max_bytes, too_large)


async def read_within(request: Request, max_bytes: int, too_large: PayloadTooLarge) -> bytes:
    """The request's body, refused with ``too_large`` as soon as it is known to be over
    ``max_bytes``: by its Content-Length (ASCII digits only: ``"²".isdigit()`` is true), or as it
    arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_urls(body: bytes, max_images: int) -> list[str]:
    """Parse and validate a JSON body of image URLs (pure; run in a thread for large bodies)."""
    text = strict_json.utf8(body, "JSON body")
    # Duplicate keys need a Python call per object (5x the C parse: 9 ms for 135 KB of empty
    # objects, against 1.9 ms). A body with no more objects than a valid one can have (braces
    # counted in C) is parsed once, with the check; any other is parsed by the C decoder alone and
    # counted and validated first, which refuses all but one whose extra braces are inside strings.
    few_objects = _at_most(body, b"{", max_images + 1)
    data = strict_json.loads(text, "JSON body", unique_keys=few_objects)
    images = data.get("images") if isinstance(data, dict) else None
    if isinstance(images, list) and len(images) > max_images:
        raise BadRequest(f"{len(images)} images; at most {max_images} per request (GATEWAY_MAX_IMAGES_PER_REQUEST)")
    try:
        urls = [image.url for image in UrlImages.model_validate(data, strict=True).images]
    except ValidationError as exc:
        raise BadRequest(f"JSON body: {_errors(exc)}") from None
    if not few_objects:
        strict_json.loads(text, "JSON body")
    return urls


def _at_most(data: bytes, byte: bytes, count: int) -> bool:
    """Whether ``data`` holds ``byte`` at most ``count`` times (memchr; stops at count + 1)."""
    at = -1
    for _ in range(count + 1):
        at = data.find(byte, at + 1)
        if at < 0:
            return True
    return False


def _errors(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    detail = validation_detail(errors[:SHOWN_ERRORS])
    if len(errors) > SHOWN_ERRORS:
        detail += f"; and {len(errors) - SHOWN_ERRORS} more"
    return detail
