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

from service.metrics import Metrics
from service.serving.catalog import CatalogError, read_models_file, reload_traffic
from service.serving.served import ServedModels
from service.settings import Settings

logger = logging.getLogger(__name__)

POLL_SECONDS = 2.0


def stamp(path: Path) -> tuple[int, int, int] | None:
    """What the watcher compares (taken when the catalog is read, so that a change made while the
    models load is applied too); None while the file is missing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino


async def reload_models(path: Path, models: ServedModels, settings: Settings, metrics: Metrics) -> bool:
    """Read ``path`` (in a thread) and apply its traffic weights (on the event loop, where requests
    pick versions); False (and a warning) when it cannot be."""
    try:
        table = await asyncio.to_thread(read_models_file, path)
        catalog = reload_traffic(models.catalog, table, settings, str(path))
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
