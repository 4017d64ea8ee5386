"""The models routes: which models are served (``GET /v1/models``), each one's metadata, and
classification by a named model and version (``POST /v1/models/{name}[/versions/{v}]/classify``,
the same work as ``/classify``, which serves the default model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.http.api import CHECKED_QUERY, QUERY_DOC, gateway_of, handle_classify
from service.http.openapi import CLASSIFY_BODY, ERRORS
from service.schemas import (
    Batching,
    ClassifyResponse,
    ErrorBody,
    JobsAccepted,
    ModelMetadata,
    ModelsList,
    ModelSummary,
    ModelVersionState,
    VersionMetadata,
)
from service.serving.served import ServedModel, ServedVersion
from service.settings import Settings

router = APIRouter()

CLASSIFY_DOC = (
    "`POST /classify`'s work (bodies, `top_k`, `mode`, errors) on the named model. Without a version, the "
    "model's traffic weights pick one (sticky per API key where the model says so); with one, that version. "
    "The answer's `model` says which version answered. 404 for an unknown model or version."
)
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such model (or version); the message lists them."}
}


def _precision(settings: Settings) -> str:
    """What the backend computes in, as far as the gateway decides it."""
    if settings.backend == "openvino":
        return settings.openvino_precision
    if settings.backend == "torch":
        return "fp32" if settings.torch_device == "cpu" else settings.torch_precision
    if settings.backend == "triton":
        return "as deployed in Triton"
    return "fp32" if settings.backend == "embedded" else "none"


def _state(model: ServedModel, served: ServedVersion) -> ModelVersionState:
    taking = sum(v.traffic for v in model.spec.versions)
    traffic = served.spec.traffic
    for spec in model.spec.versions:  # the current weights (a reload may have changed them)
        if spec.version == served.version:
            traffic = spec.traffic
    return ModelVersionState(
        version=served.version,
        profile=served.spec.profile.name,
        backend=served.backend_name,
        traffic=round(traffic / taking, 6) if taking else 0.0,
        ready=served.problem is None,
        loaded=served.running is not None,
        state=served.problem or ("ready" if served.running is not None else "not loaded (loads on first use)"),
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
    summary="A model's metadata: per version its input size, labels, precision, backend and batching",
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
                image_size=profile.image_size,
                crop_fraction=profile.crop_fraction,
                precision=_precision(settings),
                random_weights=served.random_weights,
                batching=Batching(
                    max_batch_size=settings.max_batch_size,
                    max_delay=settings.max_delay,
                    policy=settings.batch_policy,
                    max_inflight_batches=settings.max_inflight_batches,
                    max_queue_size=settings.max_queue_size,
                ),
                labels=list(profile.labels),
            )
        )
    return ModelMetadata(**summary.model_dump(exclude={"versions"}), versions=versions)


CLASSIFY_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    **NOT_FOUND,
    202: {"model": JobsAccepted, "description": "mode=offline: one job per image."},
}


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
