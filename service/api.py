"""HTTP routes: thin, they parse the request and hand the work to the Classifier."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.classifier import Classifier, ImageInput
from service.errors import BadImage, BadRequest, UnsupportedMediaType
from service.metrics import Metrics
from service.schemas import ClassifyResponse, ErrorBody, ImageResult, Label, ModelInfo, Readiness

router = APIRouter()

IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp", "image/bmp", "image/tiff")
_BINARY = {"type": "string", "format": "binary"}
_CLASSIFY_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"file": {"type": "array", "items": _BINARY, "description": "One part per image."}},
                "required": ["file"],
            }
        },
        **{t: {"schema": _BINARY} for t in (*IMAGE_TYPES, "application/octet-stream")},
    },
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "Empty, truncated or undecodable image, or a malformed multipart body.",
        413: "Body, image count or an image's pixel count over its limit.",
        415: "Content type that is not an image or multipart/form-data.",
        422: "Invalid query parameters.",
        429: "The batch queue is full; retry after Retry-After seconds.",
        500: "The backend failed on the batch.",
        503: "The backend is not ready, or the gateway is shutting down.",
        504: "The request deadline passed.",
    }.items()
}


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def _check_image_type(media: str, where: str) -> None:
    if media and not (media.startswith("image/") or media == "application/octet-stream"):
        raise UnsupportedMediaType(f"{where} has content type {media!r}; send an image")


async def _read_images(request: Request, max_images: int) -> list[ImageInput]:
    media = _media_type(request.headers.get("content-type"))
    if media == "multipart/form-data":
        try:
            form = await request.form(max_files=max_images, max_fields=max_images)
        except StarletteHTTPException as exc:
            raise BadRequest(f"malformed multipart body: {exc.detail}") from exc
        try:
            unexpected = sorted({key for key in form if key != "file"})
            if unexpected:
                raise BadRequest(f"unexpected form field(s) {unexpected}; send each image as a 'file' part")
            images: list[ImageInput] = []
            for i, part in enumerate(form.getlist("file")):
                if not isinstance(part, UploadFile):
                    raise BadRequest(f"'file' part {i + 1} is a text field, not a file upload")
                _check_image_type(_media_type(part.content_type), f"'file' part {i + 1}")
                images.append(ImageInput(await part.read(), part.filename))
        finally:
            await form.close()
        if not images:
            raise BadRequest("multipart body has no 'file' part")
        return images
    if media.startswith("image/") or media == "application/octet-stream":
        body = await request.body()
        if not body:
            raise BadImage("empty image")
        return [ImageInput(body)]
    raise UnsupportedMediaType(
        f"content type {media or 'missing'!r} is not accepted; send multipart/form-data with 'file' parts, "
        f"or an image body ({', '.join(IMAGE_TYPES)})"
    )


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses=_ERRORS,
    openapi_extra={"requestBody": _CLASSIFY_BODY},
    summary="Classify one or more images",
    description=(
        "Send images as multipart/form-data `file` parts (several are batched together) or as a raw "
        "image body. If any image of a request is bad, the whole request is refused with that image's "
        "error (naming it) and none of its images is inferred; other requests are never affected."
    ),
)
async def classify(
    request: Request,
    top_k: Annotated[int, Query(ge=1, le=20, description="How many classes to return per image.")] = 5,
) -> ClassifyResponse:
    gateway = request.app.state.gateway
    classifier: Classifier = gateway.classifier
    deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    images = await _read_images(request, gateway.settings.max_images_per_request)
    results = await classifier.classify(images, k=top_k, deadline=deadline)
    gateway.metrics.images.inc(len(results))
    return ClassifyResponse(
        model=ModelInfo(name=classifier.profile.name, version=classifier.profile.version),
        results=[
            ImageResult(filename=r.filename, labels=[Label(index=i, label=lab, score=s) for i, lab, s in r.labels])
            for r in results
        ],
    )


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Something is not ready; checks say what."}},
    summary="Readiness: the model is loaded and the backend can serve",
)
async def readyz(request: Request) -> JSONResponse:
    gateway = request.app.state.gateway
    problem = await gateway.backend.ready()
    checks = {"backend": f"{gateway.backend.name}: {problem or 'ok'}"}
    checks["batcher"] = "shutting down" if gateway.closing else "ok"
    ready = problem is None and not gateway.closing
    body = Readiness(ready=ready, checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
async def metrics(request: Request) -> PlainTextResponse:
    registry = request.app.state.gateway.metrics
    assert isinstance(registry, Metrics)
    return PlainTextResponse(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)
