"""Which models a worker serves, the queues it consumes, and what becomes of a job it does not serve.

A worker serves the models ``worker_models`` names (``worker_catalog``) and consumes their queues:
each one's, and the default model's two (``Names.queues``: its jobs queued while another model was
the default wait in ``<prefix>.work.<model>``). It declares, and samples the depth of, every model's
queues, served here or not, so a queue no worker serves is seen growing. A job names its model and
version (``resolve``); one for a model of another queue is moved there (``Misrouted``: the default
model changed while it waited), one for a model or version not served here is requeued for a worker
that serves it, for a while (``NotServedHere``), and ``GET /jobs/{id}`` says so
(``not_served_notice``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from service.errors import GatewayError
from service.jobs.headers import JobHeaders
from service.jobs.topology import Names, Route
from service.serving.catalog import Catalog, CatalogError
from service.serving.registry import ServedModels
from service.serving.served import ServedVersion

NOT_SERVED_REQUEUES = 20
"""Requeues of a job no worker has served (pauses 0.5 s doubling to 30 s: about 7 minutes) before
it fails as ``model_not_served``."""
NOT_SERVED_WAIT = "about 7 minutes"
"""How long the requeues of a job no worker serves take in all (``NOT_SERVED_REQUEUES``)."""


class NotServedHere(GatewayError):
    """The job names a model or version this worker does not serve: requeued for one that does
    (for a while: ``NOT_SERVED_REQUEUES``)."""

    status_code = 503
    error = "model_not_served"

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(detail)
        self.what = what
        """What is not served: "model 'x'", "version '2' of model 'x'"."""


class Misrouted(Exception):
    """The job names a model of another queue: it goes there."""

    def __init__(self, route: Route) -> None:
        self.route = route


def not_served_notice(what: str, requeues: int) -> str:
    """``GET /jobs/{id}``'s ``waiting`` for a job no worker serves (yet)."""
    return (
        f"no worker serves {what}: requeued for one that does ({requeues + 1} of {NOT_SERVED_REQUEUES} times, "
        f"{NOT_SERVED_WAIT} in all), then it fails as model_not_served"
    )


def worker_catalog(catalog: Catalog, wanted: str) -> Catalog:
    """The part of ``catalog`` a worker serves: the models ``wanted`` names (``worker_models``),
    all of them for ``*``, the default model alone for ""."""
    if wanted.strip() == "*":
        return catalog
    names = [name.strip() for name in wanted.split(",") if name.strip()] or [catalog.default]
    unknown = [name for name in names if catalog.model(name) is None]
    if unknown:
        raise CatalogError(
            f"worker_models names {', '.join(map(repr, unknown))}, not among the models served "
            f"({', '.join(model.name for model in catalog.models)}); a model found in Triton's index is served "
            "by a worker given '*'"
        )
    return catalog.only(names)


@dataclass(frozen=True)
class Assignment:
    """A worker's queues."""

    consumed: list[Route]
    """The queues of the models it serves, each consumed (the default model's two)."""
    known: dict[str, Route]
    """The queue of every model the gateway serves, by model (where a misrouted job is moved)."""
    declared: list[Route]
    """Every model's queues, declared and sampled (``<prefix>.work`` is declared anyway)."""


def assignment(names: Names, catalog: Catalog, served: Iterable[str]) -> Assignment:
    """The queues of a worker serving ``served`` (with "*", the models found in Triton's index too)
    among ``catalog``'s models."""
    served = list(served)
    everyone = [*(model.name for model in catalog.models), *served]
    return Assignment(
        consumed=names.queues(served, catalog.default),
        known={route.model: route for route in names.routes(everyone, catalog.default)},
        declared=list(dict.fromkeys(names.queues(everyone, catalog.default))),
    )


def resolve(models: ServedModels, known: Mapping[str, Route], job: JobHeaders, route: Route) -> ServedVersion:
    """The version of a model served here that the job names (the model of its queue if none); else
    ``Misrouted`` to its model's queue, or ``NotServedHere``."""
    name = job.model or route.model
    model = models.models.get(name)
    if model is None:
        home = known.get(name)
        if home is not None and home.queue != route.queue:
            raise Misrouted(home)
        what = f"model {name!r}"
        raise NotServedHere(what, f"no worker has served {what} (this one serves {', '.join(models.models)})")
    if job.version is None:
        return model.pick(None)
    if job.version not in model.versions:
        what = f"version {job.version!r} of model {name!r}"
        raise NotServedHere(what, f"no worker has served {what}")
    return model.versions[job.version]
