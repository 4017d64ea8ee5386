"""A models file's models (or ``--model-path``'s) written into a Triton repository: what
``gateway models triton-repo --models-file`` does, so that the gateway then serves them with
``backend = "triton"`` and the same declarations.

A declared model's file becomes its derived graph (``service.models.wrap``: uint8 RGB NHWC
``images`` in, float32 ``scores`` out), the one the in-process backends load, as
``<repository>/<triton_model>/<version>/model.onnx``; a classifier's labels go beside its config
(``label_filename``). A built-in profile is written as ``--all`` writes it, under its model's name
and version. A model already in the user's Triton (declared without ``path``) is left out: it is
there already. The versions of one Triton model share its config, so they must agree on what it
says (input size, outputs, labels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from service.models.profiles import ModelProfile
from service.serving.catalog import Catalog
from service.triton.repository import TritonOptions, render_config, write_model


class RepositoryRefused(ValueError):
    """A model of the catalog cannot be written as asked (the message names it and says why)."""


@dataclass(frozen=True)
class Entry:
    """One version to write: its Triton model and version folder, its profile and where it comes from."""

    model: str
    version: str
    profile: ModelProfile
    where: str


def entries(catalog: Catalog) -> tuple[list[Entry], list[str]]:
    """What the catalog's models put in the repository, and the notes of what it leaves out."""
    found, notes = [], []
    for spec in catalog.models:
        for version in spec.versions:
            where = f"model {spec.name!r} version {version.version!r}"
            source = version.profile.source
            if source is not None and source.format == "triton":
                notes.append(f"{where}: left out (a model already in your Triton)")
                continue
            if source is not None and source.format != "onnx":
                kind = {"openvino": "an OpenVINO IR", "torch": "a torch .pt2 file"}.get(source.format, source.format)
                raise RepositoryRefused(
                    f"{where}: {source.path.name} is {kind}; the triton backend serves a declared .onnx file "
                    "(convert the model to ONNX)"
                )
            triton_model = version.settings.triton_model or spec.name
            found.append(Entry(triton_model, version.version, version.profile, where))
    return found, notes


def write_catalog(
    repository: Path,
    catalog: Catalog,
    options: TritonOptions,
    model_file: Callable[[Entry], Path | None],
) -> tuple[list[Path], list[str]]:
    """Write the catalog's models into ``repository``; ``model_file`` gives an entry's ONNX file
    (built or derived; None: configuration files only). Returns the model folders and the notes."""
    found, notes = entries(catalog)
    groups: dict[str, list[Entry]] = {}
    for entry in found:
        groups.setdefault(entry.model, []).append(entry)
    written = []
    for name, group in groups.items():
        versions = [e.version for e in group]
        if len(set(versions)) != len(versions):
            raise RepositoryRefused(f"Triton model {name!r}: two versions {versions} share a version folder")
        if len(group) > 1 and options.variant == "tensorrt":
            raise RepositoryRefused(f"Triton model {name!r}: the tensorrt variant writes one version per model")
        files = {e.version: model_file(e) for e in group}
        own = _options(options, [f for f in files.values() if f is not None])
        first = group[0]
        config = _said(render_config(name, first.profile, own, versions))
        for other in group[1:]:
            if _said(render_config(name, other.profile, own, versions)) != config or (
                other.profile.labels != first.profile.labels
            ):
                raise RepositoryRefused(
                    f"{other.where} and {first.where} are one Triton model ({name!r}) and share its config: their "
                    "input size, outputs and labels must agree (give one a triton_model of its own)"
                )
        for entry in group:
            folder = write_model(
                repository, entry.profile, own, files[entry.version], name, version=entry.version, versions=versions
            )
        written.append(folder)
    return written, notes


def _options(options: TritonOptions, files: list[Path]) -> TritonOptions:
    """A model whose graph takes one image at a time is written with ``max_batch_size`` 1."""
    from service.models.facts import read_facts

    for file in files:
        shape = read_facts(file).inputs[0].shape
        if shape is not None and shape[0] == 1:
            return replace(options, max_batch_size=1)
    return options


def _said(config: str) -> str:
    """A config without its first line (the comment naming the file it was written from)."""
    return config.split("\n", 1)[1]
