"""Traffic weights changed without a restart: the models file is watched, and a change to its
traffic weights, shares or sticky flags is applied to the running models (a change to anything
else is refused and logged: new backends need a start). A Kubernetes ConfigMap's update (a
symlink swapped under the mount) counts as a change: the file is compared by what ``stat`` sees
through the link."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from service.metrics import Metrics
from service.models.profiles import ModelProfile
from service.serving.catalog import Catalog, CatalogError, parse_catalog, read_models_file
from service.serving.registry import ServedModels
from service.settings import Settings

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0


def _served(catalog: Catalog) -> dict[str, list[tuple[str, ModelProfile, Settings, int | None]]]:
    """What a catalog starts: per model, its versions' profiles, settings and memory in the budget
    (what the loader counts: not their weights)."""
    return {m.name: [(v.version, v.profile, v.settings, v.memory) for v in m.versions] for m in catalog.models}


def reload_traffic(catalog: Catalog, table: dict[str, Any], settings: Settings, where: str) -> Catalog:
    """``catalog`` with the traffic weights (and shares, sticky) of a reloaded models file; anything
    else changed (a model, version, profile or setting added, removed or altered) is refused: that
    needs a restart, which loads and warms the new backends."""
    if catalog.discovered:  # the models found in Triton's index at start stay (the file's own win)
        own = _object(table.get("models"))
        table = {**table, "models": {**own, **{k: v for k, v in catalog.discovered.items() if k not in own}}}
    fresh = parse_catalog(table, settings, where, base=catalog.base)
    if _served(fresh) != _served(catalog) or fresh.default != catalog.default:
        raise CatalogError(
            f"{where}: only traffic, share and sticky change without a restart; models, versions and their "
            "settings are as at start"
        )
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
    """Read and check ``path`` (in a thread) and apply its traffic weights (on the event loop, where
    requests pick versions); False (and a warning) when it cannot be."""
    try:
        table = await asyncio.to_thread(read_models_file, path)
        # in a thread too: a declared model's file is read again, a Triton model's metadata asked for
        catalog = await asyncio.to_thread(reload_traffic, models.catalog, table, settings, str(path))
    except CatalogError as exc:
        logger.warning("models file changed but not applied (the running weights stay): %s", exc)
        metrics.model_reloads.labels("refused").inc()
        return False
    except Exception:  # whatever a file can do to the parser, the watcher goes on
        logger.exception("models file changed but could not be read (the running weights stay)")
        metrics.model_reloads.labels("refused").inc()
        return False
    models.retarget(catalog)
    metrics.model_reloads.labels("applied").inc()
    logger.info(
        "models file reloaded: %s",
        "; ".join(
            f"{spec.name} share {spec.share:g}: "
            + ", ".join(f"v{version.version} {version.traffic:g}" for version in spec.versions)
            for spec in catalog.models
        ),
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
