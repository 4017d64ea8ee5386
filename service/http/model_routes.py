"""The models routes: which models are served (``GET /v1/models``), each one's metadata, and
inference by a named model and version: ``POST /v1/models/{name}[/versions/{v}]/classify`` (the same
work as ``/classify``, which serves the default model) for the models that give labels, and
``.../embed`` (the same bodies, answering vectors) for those that give embeddings."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.backends.capabilities import capabilities_of
from service.backends.triton_repository import TritonRepository
from service.errors import Conflict, Forbidden, NotFound
from service.http.answers import BINARY
from service.http.api import EMBED_QUERY_DOC, QUERY_DOC, handle_classify, handle_embed
from service.http.gateway import CHECKED_QUERY, Gateway, gateway_of
from service.http.offline_submit import ACCEPTED_DOC
from service.http.openapi import CLASSIFY_BODY, ERRORS
from service.schemas import (
    Batching,
    ClassifyResponse,
    EmbedResponse,
    ErrorBody,
    ModelMetadata,
    ModelsList,
    ModelSummary,
    ModelVersionState,
    VersionMetadata,
)
from service.serving.served import ServedModel, ServedVersion

router = APIRouter()
logger = logging.getLogger(__name__)

CLASSIFY_DOC = (
    "`POST /classify`'s work (bodies, `top_k`, `mode`, errors) on the named model. Without a version, the "
    "model's traffic weights pick one (sticky per API key where the model says so); with one, that version. "
    "The answer's `model` says which version answered. 404 for an unknown model or version; 400 "
    "`not_a_classifier` for a model that gives embeddings (its `/embed` route serves it)."
)
EMBED_DOC = (
    "The vector of each image, by a model that gives embeddings (its `output` is `embedding`): the bodies, "
    "`mode`, the version choice and the errors of `/classify`, and a 400 `not_an_embedding_model` for a model "
    "that gives labels (its `/classify` route serves it). JSON by default (each number a float32 in 9 "
    f"significant digits, which give it back exactly); `Accept: {BINARY}` answers little-endian float32 rows. "
    "With `mode=offline` each job's result carries `embedding` instead of `labels`."
)
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such model (or version); the message lists them."}
}


def _state(model: ServedModel, served: ServedVersion) -> ModelVersionState:
    taking = sum(v.traffic for v in model.spec.versions)
    traffic = served.spec.traffic
    for spec in model.spec.versions:  # the current weights (a reload may have changed them)
        if spec.version == served.version:
            traffic = spec.traffic
    state, reason = served.state
    return ModelVersionState(
        version=served.version,
        profile=served.spec.profile.name,
        backend=served.backend_name,
        traffic=round(traffic / taking, 6) if taking else 0.0,
        ready=served.problem is None,
        loaded=served.loaded,
        state=state,
        reason=reason,
    )


def _summary(request: Request, model: ServedModel) -> ModelSummary:
    return ModelSummary(
        name=model.name,
        default=model is gateway_of(request).models.default,
        ready=model.problem is None,
        share=model.spec.share,
        sticky=model.spec.sticky,
        versions=[_state(model, served) for served in model.versions.values()],
    )


@router.get(
    "/v1/models",
    dependencies=CHECKED_QUERY,
    response_model=ModelsList,
    summary="The models served, their versions and state",
)
async def list_models(request: Request) -> ModelsList:
    return ModelsList(models=[_summary(request, model) for model in gateway_of(request).models.models.values()])


@router.get(
    "/v1/models/{name}",
    dependencies=CHECKED_QUERY,
    response_model=ModelMetadata,
    responses=NOT_FOUND,
    summary="A model's metadata: per version its input size, resize, output kind, labels, precision, backend and "
    "batching",
)
async def model_metadata(request: Request, name: str) -> ModelMetadata:
    model = gateway_of(request).models.get(name)
    summary = _summary(request, model)
    versions = []
    for state in summary.versions:
        served = model.versions[state.version]
        settings, profile = served.spec.settings, served.spec.profile
        versions.append(
            VersionMetadata(
                **state.model_dump(),
                image_size=profile.height,
                input_size=[profile.height, profile.width],
                resize=profile.resize,
                crop_fraction=profile.crop_fraction,
                output=profile.output,
                threshold=profile.threshold if profile.output == "sigmoid" else None,
                dimensions=profile.outputs,
                precision=capabilities_of(settings).precision(settings),
                random_weights=served.random_weights,
                batching=Batching(
                    max_batch_size=settings.max_batch_size,
                    max_delay=settings.max_delay,
                    policy=settings.batch_policy,
                    max_inflight_batches=settings.max_inflight_batches,
                    max_queue_size=settings.max_queue_size,
                ),
                labels=list(profile.labels) if profile.classifies else None,
            )
        )
    return ModelMetadata(**summary.model_dump(exclude={"versions"}), versions=versions)


CLASSIFY_RESPONSES: dict[int | str, dict[str, Any]] = {**ERRORS, **NOT_FOUND, 202: ACCEPTED_DOC}
EMBED_RESPONSES: dict[int | str, dict[str, Any]] = {
    **CLASSIFY_RESPONSES,
    200: {
        "description": f"Each image's vector: JSON, or with `Accept: {BINARY}` its float32 rows.",
        "content": {BINARY: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            "X-Embedding-Shape": {
                "description": f"`{BINARY}` answers: `N,D`, the images and each vector's numbers.",
                "schema": {"type": "string"},
            }
        },
    },
}


ADMIN_KEY = "X-Admin-Key"
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    **NOT_FOUND,
    400: {"model": ErrorBody, "description": "Triton refused (e.g. it does not run in explicit model control mode)."},
    403: {"model": ErrorBody, "description": "X-Admin-Key missing or wrong."},
    409: {"model": ErrorBody, "description": "A version in use, or loaded at start without a memory budget."},
    503: {"model": ErrorBody, "description": "Triton unreachable, or the load did not fit the memory budget."},
}


def check_admin_key(gateway: Gateway, sent: str | None) -> None:
    """404 where the admin routes are off (no admin key set), 403 for a missing or wrong key
    (``sent``: what the caller presented, from any front)."""
    key = gateway.settings.admin_key
    if key is None:
        raise NotFound("the models' admin routes are off here (no GATEWAY_ADMIN_KEY)")
    if not hmac.compare_digest((sent or "").encode("latin-1", "replace"), key.get_secret_value().encode()):
        raise Forbidden(f"{ADMIN_KEY} is missing or wrong")


def check_admin(request: Request) -> None:
    """``check_admin_key`` for the request's ``X-Admin-Key``."""
    check_admin_key(gateway_of(request), request.headers.get(ADMIN_KEY))


async def control(request: Request, name: str, load: bool) -> ModelSummary:
    """``set_loaded`` behind the admin key, answered with the model's summary."""
    check_admin(request)
    return _summary(request, await set_loaded(gateway_of(request), name, load))


async def set_loaded(gateway: Gateway, name: str, load: bool) -> ServedModel:
    """Load or unload every version of a model: on Triton (explicit model control mode), or an
    in-process version under the memory budget. What was asked is logged. The caller checks the
    admin key (``check_admin_key``): the v1 routes here, the protocol's repository routes."""
    model = gateway.models.get(name)
    loader = gateway.models.loader
    asked = set()
    for served in model.versions.values():
        settings = served.spec.settings
        if capabilities_of(settings).on_triton:
            target = (settings.triton_url, settings.triton_protocol, settings.triton_model or name)
            if target not in asked:
                asked.add(target)
                repository = TritonRepository(target[0], settings.triton_protocol)
                await (repository.load(target[2]) if load else repository.unload(target[2]))
            if served.running is not None:
                await served.running.health.refresh()  # its readiness now, not at the next check
        elif served.lazy and loader is not None:
            if load:
                deadline = asyncio.get_running_loop().time() + gateway.settings.request_timeout
                async with gateway.models.hold(served, deadline, admit=False):
                    pass  # loaded (an operator's load is not a request in progress)
            else:
                await loader.unload_idle(served)
        else:
            raise Conflict(
                f"model {name!r} version {served.version} runs in this process and was loaded at start: it loads "
                "and unloads only under GATEWAY_MODEL_MEMORY_BUDGET"
            )
    logger.info("models: %s %s, as asked", "loaded" if load else "unloaded", name)
    return model


@router.post(
    "/v1/models/{name}/load",
    response_model=ModelSummary,
    responses=ADMIN_RESPONSES,
    summary="Load a model (admin key): on Triton in explicit mode, or in this process under the memory budget",
)
async def load_model(request: Request, name: str) -> ModelSummary:
    return await control(request, name, load=True)


@router.post(
    "/v1/models/{name}/unload",
    response_model=ModelSummary,
    responses=ADMIN_RESPONSES,
    summary="Unload a model (admin key): on Triton in explicit mode, or from this process under the memory budget",
)
async def unload_model(request: Request, name: str) -> ModelSummary:
    return await control(request, name, load=False)


@router.post(
    "/v1/models/{name}/classify",
    response_model=ClassifyResponse,
    responses=CLASSIFY_RESPONSES,
    openapi_extra={"requestBody": CLASSIFY_BODY, "parameters": QUERY_DOC},  # after FastAPI's path parameters
    summary="Classify images with a named model",
    description=CLASSIFY_DOC,
)
async def classify_model(request: Request, name: str) -> Response:
    return await handle_classify(request, name)


@router.post(
    "/v1/models/{name}/versions/{version}/classify",
    response_model=ClassifyResponse,
    responses=CLASSIFY_RESPONSES,
    openapi_extra={"requestBody": CLASSIFY_BODY, "parameters": QUERY_DOC},
    summary="Classify images with a named model version",
    description=CLASSIFY_DOC,
)
async def classify_version(request: Request, name: str, version: str) -> Response:
    return await handle_classify(request, name, version)


@router.post(
    "/v1/models/{name}/embed",
    response_model=EmbedResponse,
    responses=EMBED_RESPONSES,
    openapi_extra={"requestBody": CLASSIFY_BODY, "parameters": EMBED_QUERY_DOC},
    summary="Embed images with a named model",
    description=EMBED_DOC,
)
async def embed_model(request: Request, name: str) -> Response:
    return await handle_embed(request, name)


@router.post(
    "/v1/models/{name}/versions/{version}/embed",
    response_model=EmbedResponse,
    responses=EMBED_RESPONSES,
    openapi_extra={"requestBody": CLASSIFY_BODY, "parameters": EMBED_QUERY_DOC},
    summary="Embed images with a named model version",
    description=EMBED_DOC,
)
async def embed_version(request: Request, name: str, version: str) -> Response:
    return await handle_embed(request, name, version)
