"""Published checkpoints the gateway fetches by name: ``gateway models fetch resnet50``.

A checkpoint is pinned by URL, SHA-256 and size. ``fetch`` streams it into
``<models_dir>/checkpoints/`` through a temporary file, hashing as it goes, and keeps it only when
the digest is the pinned one (or the one given with ``--sha256``, for a checkpoint of one's own):
a truncated, corrupted or substituted file never reaches the model builder. The file is stored as
``<model>.pth`` with ``<model>.json`` beside it (URL, SHA-256, size, when), and from then on it is
the model's default weights (``weights_for``): the gateway, its workers and ``gateway
models triton-repo`` build the model from it without further settings. ``GATEWAY_MODEL_WEIGHTS``
still wins when set.

The file itself is read by ``service.models.torch_reader``, which needs no torch and runs no code
from the pickle.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from service.host.files import atomic_write
from service.settings import Settings

logger = logging.getLogger(__name__)

CHUNK = 1024 * 1024
MAX_BYTES = 4 * 1024**3
"""Largest checkpoint fetched without a pinned size (a checksum given with ``--sha256``)."""


@dataclass(frozen=True)
class Checkpoint:
    model: str
    url: str
    sha256: str
    size: int
    description: str


CHECKPOINTS: dict[str, Checkpoint] = {
    c.model: c
    for c in (
        Checkpoint(
            "resnet50",
            "https://download.pytorch.org/models/resnet50-0676ba61.pth",
            # torchvision names its files after the first 8 hex digits of their SHA-256
            "0676ba61b6795bbe1773cffd859882e5e297624d384b6993f7c9e683e722fb8a",
            102_530_333,
            "torchvision ResNet50_Weights.IMAGENET1K_V1 (ImageNet top-1 76.13 %)",
        ),
    )
}


def real_weights_hint(model: str) -> str:
    """How to give ``model`` real weights, for the warnings that say it has none."""
    if model in CHECKPOINTS:
        return f"`gateway models fetch {model}` or GATEWAY_MODEL_WEIGHTS gives it real ones"
    return "GATEWAY_MODEL_WEIGHTS gives it real ones (the trivial model has none: it measures the gateway)"


class FetchFailed(Exception):
    """The checkpoint could not be fetched or is not the pinned one; nothing was kept."""


def checkpoint_path(models_dir: Path, model: str) -> Path:
    return models_dir / "checkpoints" / f"{model}.pth"


def weights_for(settings: Settings, model: str) -> Path | None:
    """The weights file ``model`` is built from: ``model_weights`` for the configured model, else
    the checkpoint ``gateway models fetch`` kept, else None (the profile's default weights)."""
    if settings.model_weights is not None and model == settings.model:
        return settings.model_weights
    return fetched(settings.models_dir, model)


def fetched(models_dir: Path, model: str) -> Path | None:
    """The checkpoint ``fetch`` kept for ``model``, if any."""
    path = checkpoint_path(models_dir, model)
    return path if path.is_file() else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(
    checkpoint: Checkpoint,
    models_dir: Path,
    *,
    url: str | None = None,
    sha256: str | None = None,
    timeout: float = 60.0,
    progress: Callable[[int, int | None], None] | None = None,
) -> Path:
    """Download ``checkpoint`` (from ``url``, a mirror, when given), verify it against its pinned
    SHA-256 (or ``sha256``), and keep it as the model's checkpoint. A file already kept with the
    same digest is not fetched again."""
    want = (sha256 or checkpoint.sha256).lower()
    size = checkpoint.size if sha256 is None else None
    source = url or checkpoint.url
    path = checkpoint_path(models_dir, checkpoint.model)
    record = path.with_suffix(".json")
    if path.is_file() and record.is_file():
        try:
            if json.loads(record.read_text()).get("sha256") == want:
                return path
        except (OSError, json.JSONDecodeError):
            pass
    with atomic_write(path) as out:  # kept only if every check below passes
        got, received = _download(source, out, size, timeout, progress)
        if size is not None and received != size:
            raise FetchFailed(f"{source}: {received} bytes, but the pinned checkpoint has {size}")
        if got != want:
            raise FetchFailed(f"{source}: SHA-256 {got}, not the pinned {want}; the file was not kept")
    kept = {"model": checkpoint.model, "url": source, "sha256": want, "size": received, "fetched_at": time.time()}
    record.write_text(json.dumps(kept, indent=2))
    logger.info("kept %s (%d bytes, SHA-256 %s) as %s", source, received, want, path)
    return path


def _download(
    url: str,
    out: IO[bytes],
    size: int | None,
    timeout: float,
    progress: Callable[[int, int | None], None] | None,
) -> tuple[str, int]:
    """Stream ``url`` into ``out``; return the SHA-256 and the byte count. Refuses more bytes than
    ``size`` (or ``MAX_BYTES``) as soon as they arrive."""
    if not url.startswith(("https://", "http://")):
        raise FetchFailed(f"{url}: only http(s) URLs are fetched")
    limit = size if size is not None else MAX_BYTES
    digest = hashlib.sha256()
    received = 0
    request = urllib.request.Request(url, headers={"User-Agent": "inference-gateway (models fetch)"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            if total is not None and total > limit:
                raise FetchFailed(f"{url}: {total} bytes announced; at most {limit} expected")
            while chunk := response.read(CHUNK):
                received += len(chunk)
                if received > limit:
                    raise FetchFailed(f"{url}: more than the {limit} bytes expected")
                digest.update(chunk)
                out.write(chunk)
                if progress is not None:
                    progress(received, total)
    except (OSError, http.client.HTTPException) as exc:  # URLError, HTTPError, timeouts, resets, IncompleteRead
        raise FetchFailed(f"{url}: {type(exc).__name__}: {exc}") from None
    return digest.hexdigest(), received
