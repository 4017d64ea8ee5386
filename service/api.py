"""HTTP routes: thin, they parse the request and hand the work to the Classifier."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.classifier import Classifier, ImageInput
from service.errors import (
    BadImage,
    BadRequest,
    InvalidParameters,
    NotFound,
    QueueFull,
    UnsupportedMediaType,
)
from service.jobs.client import OfflineImage, PendingJob
from service.metrics import Metrics
from service.middleware import AUTHENTICATED
from service.schemas import (
    AcceptedJob,
    ClassifyResponse,
    ErrorBody,
    ImageResult,
    JobsAccepted,
    JobStatus,
    Label,
    ModelInfo,
    Readiness,
)


async def reject_unknown_query(request: Request) -> None:
    """A misspelt parameter (``topk=3``) is an error, not silently the default."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known = {param.alias for param in dependant.query_params}
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        expected = ", ".join(sorted(known)) or "none"
        raise InvalidParameters(f"unknown query parameter(s) {unknown}; this route takes: {expected}")


router = APIRouter(dependencies=[Depends(reject_unknown_query)])

MAX_FILENAME_BYTES = 255
"""Longest filename accepted in a multipart part (it is echoed in answers, job states and logs)."""
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
        408: "The request body did not arrive within GATEWAY_BODY_TIMEOUT.",
        413: "Body, image count or an image's decoded size over its limit.",
        415: "Content type that is not an image or multipart/form-data.",
        404: "Unknown job (GET /jobs/{job_id}).",
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
                if part.filename is not None and len(part.filename.encode()) > MAX_FILENAME_BYTES:
                    raise BadRequest(f"'file' part {i + 1} has a filename over {MAX_FILENAME_BYTES} bytes")
                part_type = _media_type(part.content_type)
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
        f"or an image body ({', '.join(IMAGE_TYPES)})"
    )


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses={**_ERRORS, 202: {"model": JobsAccepted, "description": "mode=offline: one job per image."}},
    openapi_extra={"requestBody": _CLASSIFY_BODY},
    summary="Classify one or more images",
    description=(
        "Send images as multipart/form-data `file` parts (several are batched together) or as a raw "
        "image body. If any image of a request is bad, the whole request is refused with that image's "
        "error (naming it) and none of its images is inferred; other requests are never affected. "
        "With `mode=offline` each image is validated from its header, queued in RabbitMQ, and the answer "
        "is 202 with a job id per image (see GET /jobs/{job_id})."
    ),
)
async def classify(
    request: Request,
    top_k: Annotated[int, Query(ge=1, le=20, description="How many classes to return per image.")] = 5,
    mode: Annotated[
        Literal["online", "offline"], Query(description="online: answer now; offline: queue and answer 202.")
    ] = "online",
) -> Any:
    gateway = request.app.state.gateway
    limit = gateway.settings.max_concurrent_requests
    if gateway.active_requests >= limit:  # full now: refuse before spending time on the body
        raise QueueFull(f"{limit} requests are already being handled; retry later")
    # The body is read before taking a slot: a slow sender never holds one (its time is bounded by
    # GATEWAY_BODY_TIMEOUT, its memory by the body budget in BodyLimitMiddleware).
    images = await _read_images(request, gateway.settings.max_images_per_request)
    deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    if gateway.active_requests >= limit:
        raise QueueFull(f"{limit} requests are already being handled; retry later")
    gateway.active_requests += 1
    try:
        if mode == "offline":
            return await _classify_offline(request, images, top_k)
        return await _classify_online(gateway, images, top_k, deadline)
    finally:
        gateway.active_requests -= 1


async def _classify_online(gateway: Any, images: list[ImageInput], top_k: int, deadline: float) -> ClassifyResponse:
    classifier: Classifier = gateway.classifier
    results = await classifier.classify(images, k=top_k, deadline=deadline)
    gateway.metrics.images.labels("online").inc(len(results))
    return ClassifyResponse(
        model=ModelInfo(name=classifier.profile.name, version=classifier.profile.version),
        results=[
            ImageResult(filename=r.filename, labels=[Label(index=i, label=lab, score=s) for i, lab, s in r.labels])
            for r in results
        ],
    )


async def _classify_offline(request: Request, images: list[ImageInput], top_k: int) -> JSONResponse:
    """Validate every image cheaply (type, header, dimensions), then publish each as a job."""
    gateway = request.app.state.gateway
    if gateway.jobs is None:  # a property of this deployment, not a passing fault: retrying cannot help
        raise BadRequest("mode=offline is not available: this gateway has no message broker (GATEWAY_BROKER_URL)")
    await gateway.classifier.validate(images)
    offline = [OfflineImage(i.data, i.content_type or "application/octet-stream", i.filename) for i in images]
    job_ids = await gateway.jobs.submit(offline, top_k)
    body = JobsAccepted(
        jobs=[
            AcceptedJob(job_id=job_id, filename=image.filename, status_url=f"/jobs/{job_id}")
            for job_id, image in zip(job_ids, images, strict=True)
        ]
    )
    return JSONResponse(body.model_dump(), status_code=202)


@router.get(
    "/jobs/{job_id}",
    response_model=JobStatus,
    responses={404: {"model": ErrorBody, "description": "Unknown job."}},
    summary="State of an offline job: pending, done (with labels) or failed (with the reason)",
)
async def job_status(request: Request, job_id: str) -> JobStatus:
    gateway = request.app.state.gateway
    state = gateway.jobs.store.get(job_id) if gateway.jobs is not None else None
    if state is None:
        raise NotFound(
            f"unknown job {job_id!r}: never accepted, forgotten (job states are kept "
            f"{gateway.settings.jobs_ttl:g} s, within GATEWAY_JOBS_CACHE_BYTES), or accepted by another replica "
            "and not finished yet"
        )
    if isinstance(state, PendingJob):
        return JobStatus(job_id=job_id, status="pending", filename=state.filename)
    error = ErrorBody(error=state.error.error, detail=state.error.detail) if state.error else None
    return JobStatus(
        job_id=job_id,
        status=state.status,
        filename=state.filename,
        labels=state.labels,
        error=error,
        model=state.model,
        timings=state.timings,
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
    problem = gateway.health.problem  # the background check's latest answer: no backend call here
    checks = {"backend": f"{gateway.backend.name}: {problem or 'ok'}"}
    checks["batcher"] = "shutting down" if gateway.closing else "ok"
    gpus = gateway.metrics.gpus_visible
    checks["gpu"] = f"ok: {gpus} visible" if gpus else "none visible: no GPU metrics from this process"
    if gateway.jobs is not None:  # informational: online requests do not need the broker
        checks["broker"] = gateway.jobs.status()
    ready = problem is None and not gateway.closing
    if not request.scope.get(AUTHENTICATED, True):  # details name internal endpoints: keys holders only
        checks = {
            name: "ok" if value.endswith("ok") else "not ready" for name, value in checks.items() if name != "gpu"
        }
    body = Readiness(ready=ready, checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
async def metrics(request: Request) -> PlainTextResponse:
    metrics = request.app.state.gateway.metrics
    assert isinstance(metrics, Metrics)
    return PlainTextResponse(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
