"""HTTP routes: thin, they parse the request and hand the work to the Classifier."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.classifier import Classification, ImageInput, validate
from service.errors import (
    BackendUnavailable,
    BadImage,
    BadRequest,
    Forbidden,
    InvalidParameters,
    NotFound,
    QuotaExceeded,
    UnsupportedMediaType,
)
from service.http.answers import Answers
from service.http.fetch import Fetcher
from service.http.json_body import read_urls
from service.http.middleware import API_KEY, AUTHENTICATED
from service.http.openapi import CLASSIFY_BODY, ERRORS
from service.http.quotas import Quotas
from service.images.files import MEDIA_TYPES
from service.jobs.client import JobsClient, JobTarget, OfflineImage
from service.jobs.owners import JOB_ID_CHARS
from service.jobs.store import PendingJob
from service.metrics import Metrics
from service.models.checkpoints import real_weights_hint
from service.schemas import (
    AcceptedJob,
    ClassifyResponse,
    ErrorBody,
    JobsAccepted,
    JobStatus,
    Readiness,
)
from service.serving.served import ServedModels, ServedVersion
from service.settings import Settings
from service.ssrf import check_destination, parse_allowlist


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


logger = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Everything a request handler needs, built once per app."""

    settings: Settings
    models: ServedModels
    metrics: Metrics
    answers: dict[int, Answers]
    """Renders each model version's online answers, by ``id`` of its ``ServedVersion``."""
    jobs: JobsClient | None = None
    quotas: Quotas | None = None
    fetcher: Fetcher | None = None
    """Fetches images given by URL (None: URL inputs are off)."""
    key_models: dict[str, frozenset[str]] = field(default_factory=dict)
    """The models each API key may use, for the keys that are limited to some (``models=``)."""
    closing: bool = False


def gateway_of(request: Request) -> Gateway:
    """The app's state, built once by its composition root (``service.http.app``)."""
    gateway = request.app.state.gateway
    assert isinstance(gateway, Gateway)
    return gateway


router = APIRouter()
CHECKED_QUERY = [Depends(reject_unknown_query)]
"""Routes with FastAPI-parsed parameters check for unknown ones this way; /classify parses its two
itself, on the hot path (see ``_classify_params``)."""

CLASSIFY_PARAMS = ("top_k", "mode")
CANCEL_ON_DISCONNECT = "gateway.cancel_on_disconnect"
"""Scope key: True when the request's work may be cancelled if its client leaves (online: nobody
would read the answer); an offline submit always finishes, so its jobs are queued whole."""
IDEMPOTENCY_KEY = "Idempotency-Key"
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
WEBHOOK_URL = "Webhook-URL"
MAX_WEBHOOK_URL = 2048
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_INTEGER = re.compile(r"[+-]?[0-9]+")
QUERY_DOC: list[dict[str, Any]] = [
    {
        "name": "top_k",
        "in": "query",
        "required": False,
        "description": "How many classes to return per image.",
        "schema": {"type": "integer", "minimum": 1, "maximum": 20, "default": 5, "title": "Top K"},
    },
    {
        "name": "mode",
        "in": "query",
        "required": False,
        "description": "online: answer now; offline: queue and answer 202.",
        "schema": {"type": "string", "enum": ["online", "offline"], "default": "online", "title": "Mode"},
    },
    {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "mode=offline: a retry with the same key and the same body gets the same job ids "
        "(202, with `Idempotent-Replayed: true` when nothing new was queued) and queues nothing new, also on "
        "another replica at the same moment; the same key with another body is 409. Remembered for "
        "GATEWAY_IDEMPOTENCY_TTL seconds, per API key. Ignored online (an online answer is computed again).",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    },
    {
        "name": WEBHOOK_URL,
        "in": "header",
        "required": False,
        "description": "mode=offline only: when each job finishes (done or failed), its result is POSTed to this "
        'URL as JSON, `{"type": "job.done"|"job.failed", "timestamp": ..., "data": <the job\'s result>}`, signed '
        "the Standard Webhooks way (`webhook-id`: the job id, `webhook-timestamp`, `webhook-signature`: "
        "`v1,` + base64 HMAC-SHA256 of `id.timestamp.body` under GATEWAY_WEBHOOK_SECRET). A 2xx answer "
        "accepts it; anything else is retried with growing delays (GATEWAY_WEBHOOK_RETRY_DELAYS) for up to "
        "GATEWAY_WEBHOOK_MAX_AGE seconds. At least once: a receiver that remembers `webhook-id` sees each "
        "job once. https only unless GATEWAY_WEBHOOK_ALLOW_HTTP; the host must resolve to public addresses "
        "unless GATEWAY_WEBHOOK_ALLOWLIST holds them (403 `url_not_allowed`). 400 when webhooks are off "
        "(no GATEWAY_WEBHOOK_SECRET), online, or the host cannot be resolved.",
        "schema": {"type": "string", "format": "uri", "maxLength": MAX_WEBHOOK_URL},
    },
]


def _classify_params(request: Request) -> tuple[int, str]:
    """``top_k`` (1-20, default 5) and ``mode`` (online|offline), with the same 422s FastAPI gives."""
    if not request.scope["query_string"]:  # the common case: no parsing at all
        return 5, "online"
    query = request.query_params
    if not query:
        return 5, "online"
    unknown = sorted(set(query) - set(CLASSIFY_PARAMS))
    if unknown:
        raise InvalidParameters(f"unknown query parameter(s) {unknown}; this route takes: mode, top_k")
    problems = []
    top_k, mode = 5, query.get("mode", "online")
    if "top_k" in query:
        raw = query["top_k"].strip()
        if not _INTEGER.fullmatch(raw):  # not int(): it takes "1_0" and non-ASCII digits
            problems.append("top_k: Input should be a valid integer, unable to parse string as an integer")
        else:
            top_k = int(raw)
            if not 1 <= top_k <= 20:
                problems.append(
                    f"top_k: Input should be {'greater' if top_k < 1 else 'less'} than or equal to "
                    f"{1 if top_k < 1 else 20}"
                )
    if mode not in ("online", "offline"):
        problems.append("mode: Input should be 'online' or 'offline'")
    if problems:
        raise InvalidParameters("; ".join(problems))
    return top_k, mode


MAX_FILENAME_BYTES = 255
"""Longest filename accepted in a multipart part (it is echoed in answers, job states and logs)."""


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
        f"or an image body ({', '.join(MEDIA_TYPES)})"
    )


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses={
        **ERRORS,
        202: {
            "model": JobsAccepted,
            "description": "mode=offline: one job per image.",
            "headers": {
                IDEMPOTENT_REPLAYED: {
                    "description": "`true` when an earlier submit with this Idempotency-Key had queued every "
                    "image: the same job ids, nothing queued again.",
                    "schema": {"type": "string", "enum": ["true"]},
                }
            },
        },
    },
    openapi_extra={"requestBody": CLASSIFY_BODY, "parameters": QUERY_DOC},
    summary="Classify one or more images",
    description=(
        "Send images as multipart/form-data `file` parts (several are batched together) or as a raw "
        "image body, or as a JSON body of image URLs for the gateway to fetch "
        '(`{"images": [{"url": "https://..."}]}`). '
        "If any image of a request is bad, the whole request is refused with that image's "
        "error (naming it) and none of its images is inferred; other requests are never affected. "
        "With `mode=offline` each image is validated from its header, queued in RabbitMQ, and the answer "
        "is 202 with a job id per image (see GET /jobs/{job_id}); with a `Webhook-URL` header each job's "
        "result is also POSTed there, signed, when it finishes."
    ),
)
async def classify(request: Request) -> Response:
    return await handle_classify(request)


async def handle_classify(request: Request, model: str | None = None, version: str | None = None) -> Response:
    """The route's work, shared by the FastAPI routes (documented in OpenAPI) and ``ClassifyFastPath``
    (what serves them: the same function without the framework's per-request layers). ``model``
    and ``version`` come from the path (None: the default model; its version by traffic)."""
    top_k, mode = _classify_params(request)
    request.scope[CANCEL_ON_DISCONNECT] = mode == "online"
    gateway = gateway_of(request)
    served = choose(request, gateway, model, version)
    admission = gateway.models.admission
    admission.check(served.model)  # full now: refuse before spending time on the body
    if _media_type(request.headers.get("content-type")) == "application/json":
        urls = await _read_urls(request, gateway)
        _spend_quota(request, gateway, len(urls), served.model)  # before fetching: the fetches are the cost
        assert gateway.fetcher is not None  # _read_urls refuses URLs where fetching is off
        async with gateway.fetcher.images(urls) as fetched:
            admission.check(served.model)
            return await _admitted(request, gateway, served, fetched, top_k, mode, version)
    # The body is read before taking a slot: a slow sender never holds one (its time is bounded by
    # GATEWAY_BODY_TIMEOUT, its memory by the body budget in BodyLimitMiddleware).
    images = await _read_images(request, gateway.settings.max_images_per_request)
    admission.check(served.model)
    _spend_quota(request, gateway, len(images), served.model)
    return await _admitted(request, gateway, served, images, top_k, mode, version)


def choose(request: Request, gateway: Gateway, model: str | None, version: str | None) -> ServedVersion:
    """The model version a request names, or (without a version) one its model's traffic weights pick."""
    chosen = gateway.models.default if model is None else gateway.models.get(model)
    key_id = request.scope.get(API_KEY)
    allowed = gateway.key_models.get(key_id) if key_id is not None else None
    if allowed is not None and chosen.name not in allowed:
        raise Forbidden(f"this API key may not use model {chosen.name!r}; it may use {', '.join(sorted(allowed))}")
    if version is not None:
        return chosen.version(version)
    return chosen.pick(request.scope.get(API_KEY))


async def _admitted(
    request: Request,
    gateway: Gateway,
    served: ServedVersion,
    images: list[ImageInput],
    top_k: int,
    mode: str,
    version: str | None,
) -> Response:
    """``version``: the one the request named (None: ``served`` was picked by traffic weights)."""
    deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    admission, loader = gateway.models.admission, gateway.models.loader
    admission.enter(served.model)
    try:
        if mode == "offline":
            return await _classify_offline(request, served, images, top_k, version)
        if WEBHOOK_URL in request.headers:
            raise BadRequest(f"{WEBHOOK_URL} is for mode=offline: an online answer is the result itself")
        if loader is not None:  # loads it (within the deadline) if it is not, holds it loaded
            await loader.acquire(served, deadline)
        try:
            return await _classify_online(gateway, served, images, top_k, deadline)
        finally:
            if loader is not None:
                loader.release(served)
    finally:
        admission.leave(served.model)


async def _read_urls(request: Request, gateway: Gateway) -> list[str]:
    if gateway.fetcher is None:
        raise UnsupportedMediaType("images by URL are turned off here (GATEWAY_URL_INPUTS); upload the images")
    settings = gateway.settings
    return await read_urls(request, settings.max_json_body_bytes_effective, settings.max_images_per_request)


def _spend_quota(request: Request, gateway: Gateway, images: int, model: str) -> None:
    key_id = request.scope.get(API_KEY)
    if gateway.quotas is None or key_id is None:
        return
    try:
        gateway.quotas.take(key_id, images, model)
    except QuotaExceeded:
        gateway.metrics.quota_rejections.labels(key_id, "rate").inc()
        raise
    gateway.metrics.key_images.labels(key_id).inc(images)


async def online(
    request: Request, served: ServedVersion, images: list[ImageInput], top_k: int | None
) -> list[np.ndarray] | list[Classification]:
    """An online request of another protocol for ``served``, admitted as ``/classify`` admits one
    (room, the API key's quota, the deadline): the ``top_k`` classes of every image, ranked with
    its batch as ``/classify``'s are, or with ``top_k`` None its probabilities over every class."""
    gateway = gateway_of(request)
    admission = gateway.models.admission
    admission.check(served.model)
    _spend_quota(request, gateway, len(images), served.model)
    deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    loader = gateway.models.loader
    admission.enter(served.model)
    try:
        if loader is not None:
            await loader.acquire(served, deadline)
        try:
            classifier = served.classifier
            if top_k is None:
                rows: list[np.ndarray] | list[Classification] = await classifier.scores(images, deadline=deadline)
            else:
                rows = await classifier.classify(images, k=top_k, deadline=deadline)
        finally:
            if loader is not None:
                loader.release(served)
    finally:
        admission.leave(served.model)
    served.metrics.images_online.inc(len(rows))
    return rows


async def _classify_online(
    gateway: Gateway, served: ServedVersion, images: list[ImageInput], top_k: int, deadline: float
) -> Response:
    results = await served.classifier.classify(images, k=top_k, deadline=deadline)
    served.metrics.images_online.inc(len(results))
    return Response(gateway.answers[id(served)].render(results), media_type="application/json")


async def _classify_offline(
    request: Request, served: ServedVersion, images: list[ImageInput], top_k: int, version: str | None
) -> JSONResponse:
    """Validate every image cheaply (type, header, dimensions), then publish each as a job to its
    model's queue, naming the version if the request did (else the workers pick one by weight)."""
    gateway = gateway_of(request)
    if gateway.jobs is None:  # a property of this deployment, not a passing fault: retrying cannot help
        raise BadRequest("mode=offline is not available: this gateway has no message broker (GATEWAY_BROKER_URL)")
    key = _idempotency_key(request)
    webhook = await _webhook_url(request, gateway.settings)
    await validate(images, served.config, served.executor)  # the queue workers classify: nothing is loaded here
    offline = [OfflineImage(i.data, i.content_type or "application/octet-stream", i.filename) for i in images]
    owner = request.scope.get(API_KEY) or ""
    target = JobTarget(gateway.jobs.names.route(served.model, gateway.models.default.name), version)
    submitted = await gateway.jobs.submit(offline, top_k, owner=owner, key=key, webhook=webhook, target=target)
    body = JobsAccepted(
        jobs=[
            AcceptedJob(job_id=job_id, filename=image.filename, status_url=f"/jobs/{job_id}")
            for job_id, image in zip(submitted.job_ids, images, strict=True)
        ]
    )
    headers = {IDEMPOTENT_REPLAYED: "true"} if submitted.replayed else None
    return JSONResponse(body.model_dump(), status_code=202, headers=headers)


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_KEY)
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.fullmatch(key):
        raise BadRequest(f"{IDEMPOTENCY_KEY} must be 1-255 printable ASCII characters")
    return key


async def _webhook_url(request: Request, settings: Settings) -> str | None:
    url = request.headers.get(WEBHOOK_URL)
    if url is None:
        return None
    if settings.webhook_secret is None:
        raise BadRequest(f"{WEBHOOK_URL}: webhooks are turned off here (no GATEWAY_WEBHOOK_SECRET)")
    if len(url) > MAX_WEBHOOK_URL:
        raise BadRequest(f"{WEBHOOK_URL}: {len(url)} characters; at most {MAX_WEBHOOK_URL}")
    if not url.isascii():  # header bytes arrive as latin-1: anything else would be another URL
        raise BadRequest(
            f"{WEBHOOK_URL}: non-ASCII bytes; send the host in IDNA (xn--) form and percent-encode the rest"
        )
    return await check_destination(
        url, WEBHOOK_URL, settings.webhook_allow_http, parse_allowlist(settings.webhook_allowlist)
    )


@router.get(
    "/jobs/{job_id}",
    dependencies=CHECKED_QUERY,
    response_model=JobStatus,
    responses={404: {"model": ErrorBody, "description": "Unknown job, or another API key's."}},
    summary="State of an offline job: pending, done (with labels) or failed (with the reason)",
)
async def job_status(request: Request, job_id: str) -> JobStatus:
    gateway = gateway_of(request)
    owner = request.scope.get(API_KEY) or ""
    state = gateway.jobs.job(job_id, owner) if gateway.jobs is not None else None
    if state is None:  # also another key's job: the same answer, so that its existence is not told
        shown = (
            repr(job_id)
            if len(job_id) <= JOB_ID_CHARS
            else f"(an id of {len(job_id)} characters; ids have {JOB_ID_CHARS})"
        )
        raise NotFound(
            f"unknown job {shown}: never accepted, forgotten (job states are kept "
            f"{gateway.settings.jobs_ttl:g} s, within GATEWAY_JOBS_CACHE_BYTES), or accepted by another replica "
            "and not finished yet"
        )
    if isinstance(state, PendingJob):
        return JobStatus(job_id=job_id, status="pending", filename=state.filename, waiting=state.waiting)
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


@router.get(
    "/healthz",
    summary="Liveness: the process answers and can serve again without a restart",
    dependencies=CHECKED_QUERY,
    responses={503: {"model": ErrorBody, "description": "A restart is due (the shared engine is gone too long)."}},
)
async def healthz(request: Request) -> dict[str, str]:
    for served in gateway_of(request).models.versions():
        if served.running is None:
            continue
        check = getattr(served.backend, "liveness", None)
        problem = check() if check is not None else None
        if problem is not None:
            raise BackendUnavailable(problem)
    return {"status": "ok"}


@router.get(
    "/readyz",
    dependencies=CHECKED_QUERY,
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Nothing can be served; checks say what is not ready."}},
    summary="Readiness: a model is loaded and its backend can serve (each model's state in checks)",
    description=(
        "Ready (200) while at least one model can answer: a failing model is named in `checks` (and its "
        "own readiness is `GET /v2/models/{name}/ready`), but it does not take the models that work out of "
        "service, which removing the pod from its Service would. 503 when no model can answer, while "
        "shutting down, or while the idempotency stream is read."
    ),
)
async def readyz(request: Request) -> JSONResponse:
    gateway = gateway_of(request)
    models = gateway.models
    versions = models.versions()
    checks: dict[str, str] = {}
    for served in versions:
        # the background check's latest answer: no backend call here
        where = "" if len(versions) == 1 else f" {served.model}/{served.version}"
        state = served.problem or ("ok" if served.running is not None else "not loaded (loads on first use): ok")
        checks[f"backend{where}"] = f"{served.backend_name}: {state}"
        runtime = getattr(served.backend, "detail", None) if served.running is not None else None
        if runtime:  # informational: what runs the model, and any fallback it took (e.g. no bf16 kernels)
            checks[f"runtime{where}"] = runtime
        profile = served.spec.profile.name
        checks[f"weights{where}"] = (
            f"RANDOM: {served.model}'s answers are meaningless; {real_weights_hint(profile)}"
            if served.random_weights
            else "ok"
        )
    failing = [model.name for model in models.models.values() if model.problem is not None]
    if len(versions) > 1:
        checks["models"] = f"not ready: {', '.join(failing)}" if failing else "ok"
    checks["batcher"] = "shutting down" if gateway.closing else "ok"
    gpus = gateway.metrics.gpus_visible
    checks["gpu"] = f"ok: {gpus} visible" if gpus else "none visible: no GPU metrics from this process"
    behind = False
    if gateway.jobs is not None:  # informational: online requests do not need the broker
        checks["broker"] = gateway.jobs.status()
        checks["idempotency"], behind = gateway.jobs.claims_status()  # not ready while it reads the claims
    ready = len(failing) < len(models.models) and not gateway.closing and not behind
    if not request.scope.get(AUTHENTICATED, True):  # details name internal endpoints and models: keys holders only
        shown = {name: value for name, value in checks.items() if not name.startswith(("gpu", "runtime", "weights"))}
        checks = {name.split(" ", 1)[0]: "ok" for name in shown}
        for name, value in shown.items():
            if not value.endswith("ok"):
                checks[name.split(" ", 1)[0]] = "not ready"
    body = Readiness(ready=ready, checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary="Prometheus metrics (OpenMetrics, with trace-id exemplars, when the Accept header asks for it)",
    dependencies=CHECKED_QUERY,
)
async def metrics(request: Request) -> Response:
    body, content_type = gateway_of(request).metrics.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
