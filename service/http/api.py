"""HTTP routes: thin, they parse the request and hand the work to the Classifier.

The image routes (``/classify`` here, a named model's ``classify`` and ``embed`` in
``service.http.model_routes``) share one path, ``handle_images``: what they take
(``service.http.image_request``, ``service.http.json_body``), admission, quotas, the deadline and
``mode=offline`` (``service.http.offline_submit``); they differ in what they ask of the model
(``WANTS``): ranked labels, or its vectors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from service.classifier import ImageInput, require_embedding, require_labels
from service.errors import BackendUnavailable, NotFound, UnsupportedMediaType
from service.http.answers import BINARY, embedding_rows, wants_binary
from service.http.gateway import CANCEL_ON_DISCONNECT as CANCEL_ON_DISCONNECT  # the fast path's import
from service.http.gateway import CHECKED_QUERY, RESERVED, choose, gateway_of, key_of, spend_quota
from service.http.gateway import Gateway as Gateway  # the composition root's import
from service.http.image_request import MODE_DOC, TOP_K_DOC, media_type, query, read_images
from service.http.json_body import read_urls
from service.http.middleware import API_KEY, AUTHENTICATED
from service.http.offline_submit import ACCEPTED_DOC, HEADERS_DOC, refuse_webhook_online, submit
from service.http.openapi import CLASSIFY_BODY, ERRORS
from service.jobs.owners import JOB_ID_CHARS
from service.jobs.store import PendingJob
from service.models.checkpoints import real_weights_hint
from service.models.profiles import ModelProfile
from service.schemas import ClassifyResponse, ErrorBody, JobStatus, Readiness
from service.serving.served import ServedVersion

logger = logging.getLogger(__name__)

router = APIRouter()
QUERY_DOC = [TOP_K_DOC, MODE_DOC, *HEADERS_DOC]
"""What ``classify`` routes take besides their body (OpenAPI ``parameters``)."""
EMBED_QUERY_DOC = [
    MODE_DOC,
    {
        "name": "Accept",
        "in": "header",
        "required": False,
        "description": f"`{BINARY}`: the vectors as little-endian float32 rows, one per image in the order "
        "sent, with their shape in `X-Embedding-Shape: N,D` and the model in `X-Model-Name` and "
        "`X-Model-Version` (a 1,280-number vector: 5 KB, against 15.5 KB of JSON). Anything else: JSON.",
        "schema": {"type": "string"},
    },
    *HEADERS_DOC,
]
"""What ``embed`` routes take besides their body."""

Answer = Callable[[Request, Gateway, ServedVersion, list[ImageInput], int, float], Awaitable[Response]]
"""An online answer: the request, its gateway, the version, the images, ``top_k`` and the deadline."""


@dataclass(frozen=True)
class Wants:
    """What an image route asks of a model: its query parameters, the output kinds that can give
    it (a refusal naming the route that serves the others), and how it answers online."""

    params: tuple[str, ...]
    require: Callable[[ModelProfile, str, str], None]
    answer: Answer


async def _labels(
    request: Request, gateway: Gateway, served: ServedVersion, images: list[ImageInput], top_k: int, deadline: float
) -> Response:
    results = await served.classifier.classify(images, k=top_k, deadline=deadline)
    served.metrics.images_online.inc(len(results))
    return Response(gateway.answers[id(served)].render(results), media_type="application/json")


async def _vectors(
    request: Request, gateway: Gateway, served: ServedVersion, images: list[ImageInput], top_k: int, deadline: float
) -> Response:
    vectors = await served.classifier.embed(images, deadline=deadline)
    served.metrics.images_online.inc(len(vectors))
    answers = gateway.answers[id(served)]
    if wants_binary(request.headers.get("accept")):
        return Response(embedding_rows(vectors), media_type=BINARY, headers=answers.embedding_headers(vectors))
    return Response(answers.render_embeddings(images, vectors), media_type="application/json")


LABELS = Wants(("mode", "top_k"), require_labels, _labels)
VECTORS = Wants(("mode",), require_embedding, _vectors)


def check_before_admission(wants: Wants, served: ServedVersion, query_string: bytes) -> None:
    """What an image route refuses before admission (its query, the model's kind of output), for
    ``service.http.early`` to ask from a request's head: a request refused for these must not be
    told 429 and retry for ever."""
    query(query_string, wants.params)
    wants.require(served.spec.profile, served.model, served.version)


@router.post(
    "/classify",
    response_model=ClassifyResponse,
    responses={**ERRORS, 202: ACCEPTED_DOC},
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
        "result is also POSTed there, signed, when it finishes. A model that gives embeddings is refused "
        "(400 `not_a_classifier`): `POST /v1/models/{name}/embed` serves it."
    ),
)
async def classify(request: Request) -> Response:
    return await handle_classify(request)


async def handle_classify(request: Request, model: str | None = None, version: str | None = None) -> Response:
    """The route's work, shared by the FastAPI routes (documented in OpenAPI) and ``ClassifyFastPath``
    (what serves them: the same function without the framework's per-request layers). ``model``
    and ``version`` come from the path (None: the default model; its version by traffic)."""
    return await handle_images(request, model, version, LABELS)


async def handle_embed(request: Request, model: str, version: str | None = None) -> Response:
    """``/v1/models/{name}[/versions/{v}]/embed``: ``classify``'s path, answering vectors."""
    return await handle_images(request, model, version, VECTORS)


async def handle_images(request: Request, model: str | None, version: str | None, wants: Wants) -> Response:
    """An image route's work: the body read, admitted and answered online or queued offline."""
    top_k, mode = query(request.scope["query_string"], wants.params)
    request.scope[CANCEL_ON_DISCONNECT] = mode == "online"
    gateway = gateway_of(request)
    served = choose(gateway, key_of(request), model, version)
    wants.require(served.spec.profile, served.model, served.version)  # before the body: it cannot help
    models = gateway.models
    reserved = request.scope.get(RESERVED)  # admitted from its head: its slot is held while the body comes
    models.check(served, reserved)  # full now: refuse before spending time on the body
    if media_type(request.headers.get("content-type")) == "application/json":
        urls = await _read_urls(request, gateway)
        spend_quota(gateway, key_of(request), len(urls), served.model)  # before fetching: the fetches are the cost
        assert gateway.fetcher is not None  # _read_urls refuses URLs where fetching is off
        async with gateway.fetcher.images(urls) as fetched:
            models.check(served, reserved)
            return await _admitted(request, gateway, served, fetched, top_k, mode, version, wants)
    # The body is read before taking a slot: a slow sender never holds one (its time is bounded by
    # GATEWAY_BODY_TIMEOUT, its memory by the body budget in BodyLimitMiddleware).
    images = await read_images(request, gateway.settings.max_images_per_request)
    models.check(served, reserved)
    spend_quota(gateway, key_of(request), len(images), served.model)
    return await _admitted(request, gateway, served, images, top_k, mode, version, wants)


async def _admitted(
    request: Request,
    gateway: Gateway,
    served: ServedVersion,
    images: list[ImageInput],
    top_k: int,
    mode: str,
    version: str | None,
    wants: Wants,
) -> Response:
    """``version``: the one the request named (None: ``served`` was picked by traffic weights)."""
    models = gateway.models
    reserved = request.scope.get(RESERVED)
    if mode == "offline":
        with models.admitted(served, reserved):
            return await submit(request, gateway, served, images, top_k, version)
    refuse_webhook_online(request)
    deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    # loads it (within the deadline) if it is not, holds it loaded; a version a reload replaced: its replacement
    async with models.hold(served, deadline, reserved=reserved) as served:
        return await wants.answer(request, gateway, served, images, top_k, deadline)


async def _read_urls(request: Request, gateway: Gateway) -> list[str]:
    if gateway.fetcher is None:
        raise UnsupportedMediaType("images by URL are turned off here (GATEWAY_URL_INPUTS); upload the images")
    settings = gateway.settings
    return await read_urls(request, settings.max_json_body_bytes_effective, settings.max_images_per_request)


@router.get(
    "/jobs/{job_id}",
    dependencies=CHECKED_QUERY,
    response_model=JobStatus,
    responses={404: {"model": ErrorBody, "description": "Unknown job, or another API key's."}},
    summary="State of an offline job: pending, done (with labels, or an embedding) or failed (with the reason)",
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
        embedding=state.embedding,
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
        if (problem := served.backend.liveness()) is not None:
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
        runtime = served.backend.detail if served.running is not None else None
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
