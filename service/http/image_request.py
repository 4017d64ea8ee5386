"""What the image routes (``/classify``, ``/v1/models/{name}/classify`` and ``.../embed``) take: their
query parameters, parsed by hand on the hot path with the errors FastAPI would give, and the images
of a multipart or image body (a JSON body of URLs is ``service.http.json_body``'s)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from starlette.datastructures import QueryParams, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.classifier import ImageInput
from service.errors import BadImage, BadRequest, InvalidParameters, UnsupportedMediaType
from service.images.files import MEDIA_TYPES

MAX_FILENAME_BYTES = 255
"""Longest filename accepted in a multipart part (it is echoed in answers, job states and logs)."""
DEFAULT_TOP_K = 5
MAX_TOP_K = 20
_INTEGER = re.compile(r"[+-]?[0-9]+")

TOP_K_DOC: dict[str, Any] = {
    "name": "top_k",
    "in": "query",
    "required": False,
    "description": "How many classes to return per image (a sigmoid model: at most this many of the labels at "
    "or above its threshold).",
    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K, "default": DEFAULT_TOP_K, "title": "Top K"},
}
MODE_DOC: dict[str, Any] = {
    "name": "mode",
    "in": "query",
    "required": False,
    "description": "online: answer now; offline: queue and answer 202.",
    "schema": {"type": "string", "enum": ["online", "offline"], "default": "online", "title": "Mode"},
}


def query(query_string: bytes, names: tuple[str, ...]) -> tuple[int, str]:
    """``top_k`` (1-20, default 5; where ``names`` has it) and ``mode`` (online|offline) from a
    request's query string, with the same 422s FastAPI gives; any other parameter is a 422 naming
    the ones the route takes."""
    if not query_string:  # the common case: no parsing at all
        return DEFAULT_TOP_K, "online"
    params = QueryParams(query_string)
    if not params:
        return DEFAULT_TOP_K, "online"
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise InvalidParameters(f"unknown query parameter(s) {unknown}; this route takes: {', '.join(sorted(names))}")
    problems = []
    top_k, mode = DEFAULT_TOP_K, params.get("mode", "online")
    if "top_k" in params:
        raw = params["top_k"].strip()
        if not _INTEGER.fullmatch(raw):  # not int(): it takes "1_0" and non-ASCII digits
            problems.append("top_k: Input should be a valid integer, unable to parse string as an integer")
        else:
            top_k = int(raw)
            if not 1 <= top_k <= MAX_TOP_K:
                problems.append(
                    f"top_k: Input should be {'greater' if top_k < 1 else 'less'} than or equal to "
                    f"{1 if top_k < 1 else MAX_TOP_K}"
                )
    if mode not in ("online", "offline"):
        problems.append("mode: Input should be 'online' or 'offline'")
    if problems:
        raise InvalidParameters("; ".join(problems))
    return top_k, mode


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


ACCEPTED_TYPES = (*MEDIA_TYPES, "application/octet-stream")
"""What an image may be sent as, as the 415 answers list it."""


def _check_image_type(media: str, where: str) -> None:
    if media and not (media.startswith("image/") or media == "application/octet-stream"):
        raise UnsupportedMediaType(f"{where} has content type {media!r}; send an image ({', '.join(ACCEPTED_TYPES)})")


async def read_images(request: Request, max_images: int) -> list[ImageInput]:
    """The images of a multipart body (each a ``file`` part) or of an image body; 400, 413 or 415
    naming what was wrong."""
    media = media_type(request.headers.get("content-type"))
    if media == "multipart/form-data":
        try:
            form = await request.form(max_files=max_images, max_fields=max_images)
        except StarletteHTTPException as exc:
            detail = str(exc.detail)
            if detail.startswith("Too many files"):  # Starlette's limits, ours
                raise BadRequest(
                    f"over {max_images} 'file' parts; at most {max_images} images per request "
                    "(GATEWAY_MAX_IMAGES_PER_REQUEST)"
                ) from exc
            if detail.startswith("Too many fields"):
                raise BadRequest(
                    f"over {max_images} text fields; a body may have at most as many parts as images per request "
                    f"({max_images}, GATEWAY_MAX_IMAGES_PER_REQUEST), and only 'file' parts are read"
                ) from exc
            raise BadRequest(f"malformed multipart body: {detail}") from exc
        try:
            unexpected = sorted({key for key in form if key != "file"})
            if unexpected:
                raise BadRequest(f"unexpected form field(s) {unexpected}; send each image as a 'file' part")
            images: list[ImageInput] = []
            for i, part in enumerate(form.getlist("file")):
                if not isinstance(part, UploadFile):
                    raise BadRequest(f"'file' part {i + 1} is a text field, not a file upload")
                if part.filename is not None and len(part.filename.encode()) > MAX_FILENAME_BYTES:
                    raise BadRequest(f"'file' part {i + 1} has a filename over {MAX_FILENAME_BYTES} bytes")
                part_type = media_type(part.content_type)
                _check_image_type(part_type, f"'file' part {i + 1}")
                images.append(ImageInput(await part.read(), part.filename, part_type or None))
        finally:
            await form.close()
        if not images:
            raise BadRequest("multipart body has no 'file' part")
        return images
    if media.startswith("image/") or media == "application/octet-stream":
        body = await request.body()
        if not body:
            raise BadImage("empty image")
        return [ImageInput(body, None, media)]
    raise UnsupportedMediaType(
        f"content type {media or 'missing'!r} is not accepted; send multipart/form-data with 'file' parts, "
        f"an image body ({', '.join(ACCEPTED_TYPES)}), or application/json with image URLs"
    )
