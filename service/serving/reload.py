"""The models file watched, and its changes applied without a restart: traffic weights, shares
and sticky flags in place; models and versions added, removed or replaced as
``service.serving.changes`` says (the new started beside the old, then switched to at once, the old
stopped once their requests are answered). A file that cannot be read, parsed or started changes
nothing: a warning says why, and the reload counts ``refused``. A Kubernetes ConfigMap's update (a
symlink swapped under the mount) counts as a change: the file is compared by what ``stat`` sees
through the link."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from service.metrics import Metrics
from service.serving.catalog import Catalog, CatalogError, parse_catalog, read_models_file
from service.serving.changes import apply, plan
from service.serving.registry import ServedModels
from service.settings import Settings

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0


def reread(catalog: Catalog, table: dict[str, Any], settings: Settings, where: str) -> Catalog:
    """The catalog of a reloaded models file (checked as at start: a declared model's file is read
    again), keeping what was found in Triton's index at start (the file's own models win)."""
    if catalog.discovered:
        own = _object(table.get("models"))
        table = {**table, "models": {**own, **{k: v for k, v in catalog.discovered.items() if k not in own}}}
    fresh = parse_catalog(table, settings, where, base=catalog.base)
    return Catalog(fresh.models, fresh.default, fresh.discovery, fresh.table, catalog.discovered, catalog.base)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def stamp(path: Path) -> tuple[int, int, int] | None:
    """What the watcher compares (taken when the catalog is read, so that a change made while the
    models load is applied too); None while the file is missing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino


async def reload_models(path: Path, models: ServedModels, settings: Settings, metrics: Metrics) -> bool:
    """Read and check ``path`` (in a thread), start what it adds, then switch to it (on the event
    loop, where requests pick versions) and stop what it retired once its requests are answered;
    False (and a warning) when it cannot be applied, with nothing changed."""
    try:
        table = await asyncio.to_thread(read_models_file, path)
        # in a thread too: a declared model's file is read again, a Triton model's metadata asked for
        fresh = await asyncio.to_thread(reread, models.catalog, table, settings, str(path))
        change = plan(models, fresh)
        await apply(models, change, settings.request_timeout)
    except CatalogError as exc:
        logger.warning("models file changed but not applied (the running models stay): %s", exc)
        metrics.model_reloads.labels("refused").inc()
        return False
    except Exception as exc:  # whatever a file or a backend's start can do, the watcher goes on
        logger.warning("models file changed but not applied (the running models stay): %s", exc, exc_info=True)
        metrics.model_reloads.labels("refused").inc()
        return False
    catalog = models.catalog
    metrics.model_reloads.labels("applied").inc()
    logger.info(
        "models file reloaded (%s): %s; default %s",
        change,
        "; ".join(
            f"{spec.name} share {spec.share:g}: "
            + ", ".join(f"v{version.version} {version.traffic:g}" for version in spec.versions)
            for spec in catalog.models
        ),
        catalog.default,
    )
    return True


async def watch_models_file(
    path: Path,
    models: ServedModels,
    settings: Settings,
    metrics: Metrics,
    seen: tuple[int, int, int] | None,
    interval: float = POLL_SECONDS,
) -> None:
    """Apply the file's changes since ``seen`` (its ``stamp`` when the catalog was read) as they
    come, until cancelled."""
    while True:
        await asyncio.sleep(interval)
        now = stamp(path)
        if now == seen or now is None:  # unchanged, or gone for a moment (an editor's rename)
            continue
        seen = now
        await reload_models(path, models, settings, metrics)
