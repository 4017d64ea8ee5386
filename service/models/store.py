"""The models directory: ONNX files built once, then reused.

Layout: ``<models_dir>/<name>/<version>/model.onnx`` plus ``build.json`` recording what it was built
from, so a changed weights file or builder revision triggers a rebuild. Writes are atomic (temporary
file, then rename), so a crash or a concurrent build never leaves a half-written model behind.

A declared model (a user's file, ``service.models.reading``) is derived into
``<models_dir>/declared/<name>/<version>/``: ``model.onnx`` for an ONNX file, ``model.xml`` and
``model.bin`` for an OpenVINO IR (``service.models.wrap``). Its ``build.json`` records the file's
SHA-256 and everything the declaration puts in the graph, so a changed file or declaration rebuilds
it; the user's file is only read.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

from service.host.files import atomic_folder, atomic_write
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
    """The model file the backends load: an ONNX file, or an OpenVINO IR for a declared IR."""
    if profile.source is not None:
        file = "model.xml" if profile.source.format == "openvino" else "model.onnx"
        return models_dir / "declared" / profile.name / profile.version / file
    return models_dir / profile.name / profile.version / "model.onnx"


def model_bytes(models_dir: Path, profile: ModelProfile) -> int:
    """The size of the built model on disk (an IR's ``.bin`` with its ``.xml``); OSError if not built."""
    path = model_path(models_dir, profile)
    size = path.stat().st_size
    if path.suffix == ".xml":
        size += path.with_suffix(".bin").stat().st_size
    return size


def ensure_model(models_dir: Path, profile: ModelProfile, weights: Path | None = None, *, force: bool = False) -> Path:
    """Return the path of the model's file, building it first if missing or stale (a declared
    model: derived from its file, which takes no weights file)."""
    if profile.source is not None:
        if weights is not None:
            raise ValueError(
                f"{profile.name} is declared by its file ({profile.source.path}); it takes no weights file"
            )
        return _ensure_declared(models_dir, profile, force=force)
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


def _ensure_declared(models_dir: Path, profile: ModelProfile, *, force: bool) -> Path:
    """A declared model's derived file, from the bytes its fingerprint hashed (a file replaced
    while it is read is built as it was hashed, or refused as changed)."""
    from service.models import wrap
    from service.models.facts import ModelFileError, load_onnx, read_content

    source = profile.source
    assert source is not None
    path = model_path(models_dir, profile)
    try:
        content = read_content(source.path)  # an IR's weights mapped and hashed streaming, not read whole
        wrap.check_unchanged(content, source)
    except ModelFileError as exc:
        raise ModelFileError(f"model {profile.name!r} version {profile.version!r}: {source.path} {exc}") from None
    file = {"name": source.path.name, "size": len(content.data), "sha256": content.sha256}
    if content.weights_sha256 is not None:
        file["weights_sha256"] = content.weights_sha256
    declaration = {
        "arithmetic": asdict(source.arithmetic),
        "input_name": source.input_name,
        "output_name": source.output_name,
        "input_size": profile.input_size,
        "output": profile.output,
        "dimensions": profile.dimensions,
    }
    fingerprint = json.loads(json.dumps({  # as build.json reads back (tuples are lists there)
        "model": profile.name,
        "version": profile.version,
        "builder_revision": profile.builder_revision,
        "file": file,
        "declaration": declaration,
    }))  # fmt: skip
    meta_path = path.with_name("build.json")
    if not force and path.exists() and _recorded(meta_path) == fingerprint:
        return path
    logger.info("deriving %s version %s from %s into %s", profile.name, profile.version, source.path, path)
    try:
        if source.format == "openvino":
            import openvino as ov

            model = wrap.derive_openvino(content, source, profile.input_size, profile.output)
            with atomic_folder(path.parent) as tmp:
                ov.save_model(model, str(tmp / path.name), compress_to_fp16=False)
                built = (tmp / path.name).read_bytes() + (tmp / path.with_suffix(".bin").name).read_bytes()
                meta = dict(fingerprint, sha256=hashlib.sha256(built).hexdigest())
                (tmp / meta_path.name).write_text(json.dumps(meta, indent=2))
            return path
        graph = wrap.derive(load_onnx(content.data), source, profile.input_size, profile.output)
    except ModelFileError as exc:
        raise ModelFileError(f"model {profile.name!r} version {profile.version!r}: {source.path} {exc}") from None
    built = graph.SerializeToString()
    with atomic_write(path) as out:
        out.write(built)
    with atomic_write(meta_path) as out:
        out.write(json.dumps(dict(fingerprint, sha256=hashlib.sha256(built).hexdigest()), indent=2).encode())
    return path


def _recorded(meta_path: Path) -> object:
    """What ``build.json`` says a model was built from (its own SHA-256 aside), or None."""
    try:
        stored = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(stored, dict):
        stored.pop("sha256", None)
    return stored


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 of a model file ``ensure_model`` built, as its ``build.json`` recorded it."""
    try:
        sha = json.loads(path.with_name("build.json").read_text()).get("sha256")
    except (OSError, json.JSONDecodeError):
        return None
    return str(sha) if sha else None
