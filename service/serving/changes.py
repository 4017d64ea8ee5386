"""A reloaded models file applied to the running models, without a restart.

What the file adds is started first, beside what serves now: a model added, a version added, and
a version replaced (its profile, declaration, ``path`` or settings changed, or its declared file
replaced by another at the same path: the SHA-256 its profile records, read again by the parse).
Only once all of that has started (a backend that fails to start changes nothing: the error goes
on and the reload is refused) does the registry switch, on the event loop and without a pause in
between: the new versions' answer renderers exist, the models and versions the file no longer
names leave the registry (their new requests get 404 at once), and the replaced versions' new
requests go to their replacements. What was removed or replaced is then *retired*: the requests
that chose it before the switch are answered by it (``ServedModels.hold`` counts them), and it is
stopped once none holds it, ``request_timeout`` at most (its batcher drained, its backend closed);
a removed model's lane and shares go with it. Its metrics series stay.

The current default model cannot disappear unnoticed: a file that drops it without naming another
``default`` is refused. The offline queue worker keeps the models it started with (a restart
serves the new ones offline), as do the job queues declared by the gateway at start.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from service.serving.catalog import Catalog, CatalogError, ModelSpec, VersionSpec
from service.serving.registry import ServedModels
from service.serving.served import ServedModel, ServedVersion

logger = logging.getLogger(__name__)


@dataclass
class Change:
    """What a reloaded catalog changes in the running models (see ``plan``)."""

    catalog: Catalog
    added: list[ModelSpec] = field(default_factory=list)
    """Models the file names now and did not."""
    removed: list[str] = field(default_factory=list)
    """Models it no longer names."""
    started: dict[str, list[VersionSpec]] = field(default_factory=dict)
    """Per model kept: its versions added or replaced (started beside the running ones)."""

    def __str__(self) -> str:
        parts = [f"added model {spec.name}" for spec in self.added]
        parts += [f"removed model {name}" for name in self.removed]
        parts += [f"started {name} version {v.version}" for name, specs in self.started.items() for v in specs]
        return "; ".join(parts) or "traffic only"


def _running(spec: VersionSpec) -> tuple[object, ...]:
    """What a running version is made of (its traffic aside: that changes in place); a declared
    profile holds its file's SHA-256, so a file replaced at the same path compares unequal."""
    return spec.profile, spec.settings, spec.memory


def plan(models: ServedModels, fresh: Catalog) -> Change:
    """What ``fresh`` changes in ``models``; ``CatalogError`` if it drops the default model without
    naming another."""
    current = models.catalog
    names = {spec.name for spec in fresh.models}
    if current.default not in names and "default" not in fresh.table:
        raise CatalogError(
            f"model {current.default!r} is the default (what /classify serves) and the models file no longer "
            f'names it: name the new default first (default = "...", one of {", ".join(sorted(names))})'
        )
    change = Change(fresh, removed=[name for name in models.models if name not in names])
    for spec in fresh.models:
        model = models.models.get(spec.name)
        if model is None:
            change.added.append(spec)
            continue
        started = [
            version
            for version in spec.versions
            if (old := model.versions.get(version.version)) is None or _running(old.spec) != _running(version)
        ]
        if started:
            change.started[spec.name] = started
    return change


async def apply(models: ServedModels, change: Change, drain_timeout: float) -> None:
    """Start what ``change`` adds, switch the registry to ``change.catalog``, then stop what it
    retired once its requests are answered (``drain_timeout`` at most). A start that fails stops
    what was started and raises: nothing changed."""
    assembly = models.assembly
    if assembly is None:
        raise CatalogError("this process serves the models it started with; restart it to serve others")
    made: list[ServedVersion] = []
    grown: dict[str, ServedModel] = {}
    try:
        for spec in change.added:
            grown[spec.name] = assembly.model(spec)
            made.extend(grown[spec.name].versions.values())
        replacing: dict[tuple[str, str], ServedVersion] = {}
        for name, specs in change.started.items():
            model = models.models[name]
            executor = model.lane if model.lane is not None else assembly.pool
            for version in specs:
                old = model.versions.get(version.version)
                served = assembly.version(name, version, executor)
                if old is not None and old.metrics.backend == served.metrics.backend:
                    served.metrics = old.metrics  # one series per version: its gauges follow the new batcher
                replacing[name, version.version] = served
                made.append(served)
        for served in made:
            if not served.lazy:
                served.running = await assembly.start(served)
    except BaseException:
        await asyncio.gather(*(assembly.stop(s.running) for s in made if s.running is not None), return_exceptions=True)
        for served in made:
            served.running = None
            assembly.forget(served)
        for model in grown.values():
            assembly.drop_model(model)
        raise
    gone = [models.models[name] for name in change.removed]
    retired = _switch(models, change, made, grown, replacing)
    await asyncio.gather(*(_retire(models, served, drain_timeout) for served in retired))
    for model in gone:  # its requests answered: its lane and shares go
        assembly.drop_model(model)
    for name in change.removed:
        models.admission.forget(name)
        if models.bodies is not None:
            models.bodies.forget(name)


def _switch(
    models: ServedModels,
    change: Change,
    made: list[ServedVersion],
    grown: dict[str, ServedModel],
    replacing: dict[tuple[str, str], ServedVersion],
) -> list[ServedVersion]:
    """The registry switched to ``change.catalog``, all at once (no ``await``: no request sees half
    of it); the versions retired."""
    for served in made:  # their answer renderers first
        for added in models.on_added:
            added(served)
    retired: list[ServedVersion] = []
    serving: dict[str, ServedModel] = {}
    for spec in change.catalog.models:
        if spec.name in grown:
            serving[spec.name] = grown[spec.name]
            continue
        model = models.models[spec.name]
        versions = {
            v.version: replacing.get((spec.name, v.version)) or model.versions[v.version] for v in spec.versions
        }
        retired += [old for key, old in model.versions.items() if versions.get(key) is not old]
        model.versions = versions
        model.route(spec)
        serving[spec.name] = model
    gone = [models.models[name] for name in change.removed]
    retired += [served for model in gone for served in model.versions.values()]
    for served in retired:
        served.retired = True
    models.models = serving
    models.default = serving[change.catalog.default]
    models.catalog = change.catalog
    shares = {spec.name: spec.share for spec in change.catalog.models}
    models.admission.reshare(shares)
    if models.bodies is not None:
        models.bodies.reshare(shares)
    if models.loader is not None:  # a retired version is neither loaded again nor unloaded for another
        models.loader.versions = [v for v in models.loader.versions if not v.retired] + [v for v in made if v.lazy]
    return retired


async def _retire(models: ServedModels, served: ServedVersion, drain_timeout: float) -> None:
    """Stop ``served`` once no request holds it (``drain_timeout`` at most)."""
    try:
        async with asyncio.timeout(drain_timeout):
            while served.held or served.loading:
                if served.held:
                    await served.idle.wait()
                else:  # a load its requests gave up on: it finishes on its own, then is stopped here
                    await asyncio.sleep(0.05)
    except TimeoutError:
        logger.warning(
            "model %s version %s: still held by %d request(s) after %g s; stopped",
            served.model,
            served.version,
            served.held,
            drain_timeout,
        )
    served.stopping = True  # a request that chose it reaches its replacement (or 404) from here on
    assembly = models.assembly
    assert assembly is not None
    running, served.running = served.running, None
    if running is not None:
        await assembly.stop(running)
    assembly.forget(served)
    for removed in models.on_removed:
        removed(served)
    logger.info("model %s version %s stopped (the models file changed)", served.model, served.version)
