"""The models directory: ONNX files built once, then reused.

Layout: ``<models_dir>/<name>/<version>/model.onnx`` plus ``build.json`` recording what it was built
from, so a changed weights file or builder revision triggers a rebuild. Writes are atomic (temporary
file, then rename), so a crash or a concurrent build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from service.host.files import atomic_write
from service.models.profiles import ModelProfile

logger = logging.getLogger(__name__)


class ModelToolsMissing(RuntimeError):
    """The model is not built and this install cannot build it (no ``models`` extra)."""


def _fingerprint(profile: ModelProfile, weights: Path | None) -> dict[str, object]:
    """What a built model was built from. A weights file is known by its content, not its path or
    times: an image layer keeps whole seconds of a file's time, and a moved models folder is the same
    model (hashing a 100 MB checkpoint takes a fraction of a second, once per start)."""
    source: object = "default"
    if weights is not None:
        with weights.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        source = {"size": weights.stat().st_size, "sha256": digest}
    return {"model": profile.name, "builder_revision": profile.builder_revision, "weights": source}


def model_path(models_dir: Path, profile: ModelProfile) -> Path:
    return models_dir / profile.name / profile.version / "model.onnx"


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
    try:
        graph = profile.build(weights)
    except ModuleNotFoundError as exc:  # a serving-only install (the runtime image) has no builder
        raise ModelToolsMissing(
            f"{profile.name} is not built in {models_dir}, and building it needs {exc.name!r}: "
            "pip install 'inference-gateway[models]', or bake it into the image "
            f"(docker build --build-arg MODELS='{profile.name} ...')"
        ) from exc
    data = graph.SerializeToString()
    with atomic_write(path) as out:
        out.write(data)
    meta = dict(fingerprint, sha256=hashlib.sha256(data).hexdigest())
    with atomic_write(meta_path) as out:
        out.write(json.dumps(meta, indent=2).encode())
    return path


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 of a model file ``ensure_model`` built, as its ``build.json`` recorded it."""
    try:
        sha = json.loads(path.with_name("build.json").read_text()).get("sha256")
    except (OSError, json.JSONDecodeError):
        return None
    return str(sha) if sha else None
