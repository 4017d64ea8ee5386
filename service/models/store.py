"""The models directory: ONNX files built once, then reused.

Layout: ``<models_dir>/<name>/<version>/model.onnx`` plus ``build.json`` recording what it was built
from, so a changed weights file or builder revision triggers a rebuild. Writes are atomic (temporary
file, then rename), so a crash or a concurrent build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from service.models.profiles import ModelProfile

logger = logging.getLogger(__name__)


def _fingerprint(profile: ModelProfile, weights: Path | None) -> dict[str, object]:
    source: object = "default"
    if weights is not None:
        stat = weights.stat()
        source = {"path": str(weights.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"model": profile.name, "builder_revision": profile.builder_revision, "weights": source}


def model_path(models_dir: Path, profile: ModelProfile) -> Path:
    return models_dir / profile.name / profile.version / "model.onnx"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_model(models_dir: Path, profile: ModelProfile, weights: Path | None = None, *, force: bool = False) -> Path:
    """Return the path of the model's ONNX file, building it first if missing or stale."""
    path = model_path(models_dir, profile)
    meta_path = path.with_name("build.json")
    fingerprint = _fingerprint(profile, weights)
    if not force and path.exists() and meta_path.exists():
        try:
            stored = json.loads(meta_path.read_text())
            stored.pop("sha256", None)
            if stored == fingerprint:
                return path
        except json.JSONDecodeError:
            pass
    logger.info("building %s into %s", profile.name, path)
    data = profile.build(weights).SerializeToString()
    _atomic_write(path, data)
    meta = dict(fingerprint, sha256=hashlib.sha256(data).hexdigest())
    _atomic_write(meta_path, json.dumps(meta, indent=2).encode())
    return path


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 of a model file ``ensure_model`` built, as its ``build.json`` recorded it."""
    try:
        sha = json.loads(path.with_name("build.json").read_text()).get("sha256")
    except (OSError, json.JSONDecodeError):
        return None
    return str(sha) if sha else None
