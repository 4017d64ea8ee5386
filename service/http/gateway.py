"""What every front asks of the app: its state (``Gateway``, built once by ``service.http.app``),
the model version a request names, its API key's quota, the query parameters it may send, and
(``online``) an inference protocol's one door to a served model, the same for REST and gRPC."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from fastapi import Depends, Request

from service.classifier import Classification, ImageInput, require_labels
from service.errors import Forbidden, InvalidParameters, QuotaExceeded
from service.http.answers import Answers
from service.http.fetch import Fetcher
from service.http.middleware import API_KEY
from service.http.middleware import RESERVED as RESERVED  # the routes' import
from service.http.quotas import Quotas
from service.jobs.client import JobsClient
from service.metrics import Metrics
from service.serving.fair import Reservation
from service.serving.registry import ServedModels
from service.serving.served import ServedVersion
from service.settings import Settings
from service.settings.keys import ApiKey
from service.tracing import Tracing

CANCEL_ON_DISCONNECT = "gateway.cancel_on_disconnect"
"""Scope key: True when the request's work may be cancelled if its client leaves (online: nobody
would read the answer); an offline submit always finishes, so its jobs are queued whole."""


@dataclass
class Gateway:
    """Everything a request handler needs, built once per app."""

    settings: Settings
    models: ServedModels
    metrics: Metrics
    answers: dict[int, Answers]
    """Renders each model version's online answers, by ``id`` of its ``ServedVersion`` (kept current
    by the registry's ``on_added``/``on_removed`` as a reloaded models file changes the versions)."""
    jobs: JobsClient | None = None
    quotas: Quotas | None = None
    fetcher: Fetcher | None = None
    """Fetches images given by URL (None: URL inputs are off)."""
    key_models: dict[str, frozenset[str]] = field(default_factory=dict)
    """The models each API key may use, for the keys that are limited to some (``models=``)."""
    keys: list[ApiKey] = field(default_factory=list)
    """The API keys (none: keys are off), for the fronts that check them outside the HTTP stack."""
    tracing: Tracing | None = None
    closing: bool = False


def gateway_of(request: Request) -> Gateway:
    """The app's state, built once by its composition root (``service.http.app``)."""
    gateway = request.app.state.gateway
    assert isinstance(gateway, Gateway)
    return gateway


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


CHECKED_QUERY = [Depends(reject_unknown_query)]
"""Routes with FastAPI-parsed parameters check for unknown ones this way; the image routes parse
theirs themselves, on the hot path (``service.http.image_request.query``)."""


def choose(gateway: Gateway, key_id: str | None, model: str | None, version: str | None) -> ServedVersion:
    """The model version a request names, or (without a version) one its model's traffic weights
    pick; ``key_id``: the caller's API key's id (None: keys are off), which may be limited to some
    models (403 for another)."""
    chosen = gateway.models.default if model is None else gateway.models.get(model)
    allowed = gateway.key_models.get(key_id) if key_id is not None else None
    if allowed is not None and chosen.name not in allowed:
        raise Forbidden(f"this API key may not use model {chosen.name!r}; it may use {', '.join(sorted(allowed))}")
    if version is not None:
        return chosen.version(version)
    return chosen.pick(key_id)


def spend_quota(gateway: Gateway, key_id: str | None, images: int, model: str) -> None:
    """Take ``images`` from the API key's rate quota for ``model`` (429 when over it)."""
    if gateway.quotas is None or key_id is None:
        return
    try:
        gateway.quotas.take(key_id, images, model)
    except QuotaExceeded:
        gateway.metrics.quota_rejections.labels(key_id, "rate").inc()
        raise
    gateway.metrics.key_images.labels(key_id).inc(images)


def key_of(request: Request) -> str | None:
    """The id of the HTTP request's API key (``ApiKeyMiddleware`` put it in the scope)."""
    return request.scope.get(API_KEY)


async def online(
    gateway: Gateway,
    key_id: str | None,
    served: ServedVersion,
    images: list[ImageInput],
    top_k: int | None,
    deadline: float | None = None,
    reserved: Reservation | None = None,
) -> list[np.ndarray] | list[Classification]:
    """An online request of an inference protocol (the v2 REST and gRPC fronts) for ``served``,
    admitted as ``/classify`` admits one (room, the API key's quota, the deadline: the sooner of
    ``deadline``, event-loop time, and the request timeout): the ``top_k`` classes of every image,
    ranked with its batch as ``/classify``'s are (a sigmoid model's too, whatever their score: a
    protocol's tensor has ``top_k`` of them in every row), or with ``top_k`` None its score rows (an
    embedding model's vectors). Classes asked of an embedding model are refused before anything is
    spent. ``reserved``: the slot its head was admitted with (REST)."""
    if top_k is not None:
        require_labels(served.spec.profile, served.model, served.version)
    models = gateway.models
    models.check(served, reserved)
    spend_quota(gateway, key_id, len(images), served.model)
    timeout = asyncio.get_running_loop().time() + gateway.settings.request_timeout
    deadline = timeout if deadline is None else min(deadline, timeout)
    async with models.hold(
        served, deadline, reserved=reserved
    ) as served:  # a version a reload replaced: its replacement
        classifier = served.classifier
        if top_k is None:
            rows: list[np.ndarray] | list[Classification] = await classifier.scores(images, deadline=deadline)
        else:
            rows = await classifier.classify(images, k=top_k, deadline=deadline, thresholded=False)
    served.metrics.images_online.inc(len(rows))
    return rows
