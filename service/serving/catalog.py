"""What the gateway serves: its models, each with versions, read from the settings and the models file.

Without ``GATEWAY_MODELS`` or ``GATEWAY_MODELS_FILE`` the gateway serves one model, ``GATEWAY_MODEL``,
as it always has. ``GATEWAY_MODELS=efficientnet-lite0,trivial`` serves several models named after
their profiles, one version each, all on the gateway's settings. A models file (TOML) names them and
gives each its own backend and batcher settings, versions and shares::

    default = "products"              # what /classify serves (default: the first model)

    [models.products]
    profile = "efficientnet-lite0"    # the graph: efficientnet-lite0, resnet50, trivial
    share = 3                         # weight in the fair sharing of admission and decoding
    max_batch_size = 32               # any per-model setting (ModelSettings)

    [models.products.versions.1]
    traffic = 90                      # weighted routing between versions (canaries)
    [models.products.versions.2]
    profile = "resnet50"
    traffic = 10

A version's per-model settings are one ``ModelSettings`` (``service.settings.model``): its table's
keys over its model's, over the gateway's values, checked at start as one class with the settings'
own rules, and an error names the model, the version and the key. What the whole process shares
(decode pool, budgets, timeouts) stays in the gateway's one ``Settings``. A reload
(``service.serving.reload``) may change traffic weights, shares and sticky flags, and nothing else.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from service.backends.capabilities import budget_problem, capabilities_of, run_problem, shares_engine
from service.models.declaration import DECLARED_KEYS, DeclarationError, parse_declaration
from service.models.profiles import ModelProfile, get_profile
from service.settings import Settings
from service.settings.model import ModelSettings
from service.settings.values import MAX_INT, MODEL_NAME, read_regular_file, setting_name

NAME = MODEL_NAME
"""A model's name: lower case, digits and ``_.-``, at most 64 characters (a URL path segment and a
metric label value as it is)."""
VERSION = re.compile(r"[1-9][0-9]{0,8}")
"""A version: a positive integer, as Triton's and the Open Inference Protocol's versions are."""
MAX_MODELS = 32
MAX_VERSIONS = 8
"""Bounds that keep metrics' label sets (model x version) and the per-model machinery small."""
MAX_FILE_BYTES = 1024 * 1024
MIN_SHARE = 0.001
"""Smallest share: a share's inverse is how far its lane's virtual time moves per decode."""

MODEL_KEYS = {"profile", "share", "sticky", "versions", "memory", *ModelSettings.model_fields, *DECLARED_KEYS}
VERSION_KEYS = {"profile", "traffic", "memory", *ModelSettings.model_fields, *DECLARED_KEYS}
"""A model's and a version's keys: the catalog's own, the per-model settings (the rest, decode pool,
budgets, admission, timeouts, belong to the whole gateway) and a declared model's."""
DECLARED_VERSION = "1"
"""A declared model's version where the file gives none."""


@dataclass(frozen=True)
class VersionSpec:
    version: str
    profile: ModelProfile
    own: ModelSettings
    """Its per-model settings (backend, batcher, breaker): its table's, its model's, else the gateway's."""
    gateway: Settings
    """The gateway's one settings: what the whole process shares."""
    traffic: float
    """Relative weight of this version in its model's unversioned requests (0: only by its version's route)."""
    memory: int | None = None
    """Bytes it takes in ``model_memory_budget`` when loaded (None: estimated from its model file)."""

    @cached_property
    def settings(self) -> Settings:
        """The gateway's settings with this version's own applied: what a backend's and a batcher's
        builders read, which take one ``Settings``."""
        return applied(self.gateway, self.own, self.profile.name)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    versions: tuple[VersionSpec, ...]
    share: float
    """Weight in the fair sharing of admission and the decode pool between models."""
    sticky: bool
    """Route each API key to the same version (by a hash of key and model), not each request at random."""

    def version(self, version: str) -> VersionSpec | None:
        return next((v for v in self.versions if v.version == version), None)


@dataclass(frozen=True)
class Discovery:
    """A models file's ``[triton]`` table: serve every model of this Triton's repository index too."""

    url: str
    protocol: Literal["grpc", "http"]
    profile: str
    """The profile its models are taken to be (input size, crop, labels), checked against each
    model's metadata by its readiness check."""
    share: float = 1.0
    """Each found model's share in the fair sharing."""


@dataclass(frozen=True)
class Catalog:
    models: tuple[ModelSpec, ...]
    default: str
    """The model ``/classify`` and the queue worker serve."""
    discovery: Discovery | None = None
    table: dict[str, Any] = field(default_factory=dict, compare=False)
    """What it was parsed from (the models file's tables), to add discovered models to."""
    discovered: dict[str, Any] = field(default_factory=dict, compare=False)
    """The ``[models.NAME]`` tables made for the models found in Triton's index."""
    base: Path = field(default_factory=Path.cwd, compare=False)
    """The folder a declared model's relative paths start from: the models file's."""

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def only(self, names: Sequence[str]) -> Catalog:
        """This catalog with some of its models alone (what a queue worker serves), without the
        models Triton's index would add; its default stays, if among them."""
        return Catalog(
            tuple(m for m in self.models if m.name in names),
            self.default if self.default in names else names[0],
            base=self.base,
        )


class CatalogError(ValueError):
    """The models setting or file is wrong: the message says where."""


def load_catalog(settings: Settings) -> Catalog:
    """The models this gateway serves, from ``models_file``, ``models`` or ``model`` (in that order).

    ``model`` alone is served on the gateway's settings as they are (its weights, Triton model and
    version). A model of ``models`` or of the file takes only what the file gives it of those:
    the gateway-wide ``model_weights``, ``triton_model`` and ``triton_model_version`` name one
    model's files, not every model's."""
    if settings.models_file is not None:
        table = read_models_file(settings.models_file)
        return parse_catalog(table, settings, str(settings.models_file), base=settings.models_file.parent)
    if settings.model_path is not None:
        name = settings.model if "model" in settings.model_fields_set else _name_of(settings.model_path)
        table = {"models": {name: settings.declared()}}
        where = f"{setting_name('model_path')}: model {name!r} version {DECLARED_VERSION!r}"
        return parse_catalog(table, settings, where, inherit=True)
    if not settings.models.strip():
        table = {"models": {settings.model: {"profile": settings.model}}}
        return parse_catalog(table, settings, setting_name("model"), inherit=True)
    names = [part.strip() for part in settings.models.split(",") if part.strip()]
    if len(set(names)) != len(names):
        raise CatalogError(f"{setting_name('models')}: {settings.models!r} names a model twice")
    return parse_catalog({"models": {name: {"profile": name} for name in names}}, settings, setting_name("models"))


def _name_of(path: Path) -> str:
    """A served name from a model file's name (``Cars_v2.onnx``: ``cars_v2``)."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", path.stem.lower()).strip("-._")[:64]
    return name if NAME.fullmatch(name) else "model"


def read_models_file(path: Path) -> dict[str, Any]:
    try:
        text = read_regular_file(path, MAX_FILE_BYTES, setting_name("models_file"))
    except ValueError as exc:
        raise CatalogError(str(exc)) from None
    try:
        return tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        problem = exc or "nested too deep"
        raise CatalogError(f"{setting_name('models_file')}: {path} is not valid TOML: {problem}") from None


def parse_catalog(
    table: dict[str, Any], settings: Settings, where: str, *, inherit: bool = False, base: Path | None = None
) -> Catalog:
    """``inherit``: the gateway's one model, on the gateway's settings as they are (see ``load_catalog``).
    ``base``: where a declared model's relative paths start (default: the working directory)."""
    base = base if base is not None else Path.cwd()
    unknown = set(table) - {"default", "models", "triton"}
    if unknown:
        raise CatalogError(
            f"{where}: unknown key(s) {sorted(unknown)}; expected default, [models.NAME] tables and [triton]"
        )
    discovery = _discovery(table.get("triton"), settings, where)
    models_table = table.get("models")
    if not isinstance(models_table, dict) or not models_table:
        raise CatalogError(f"{where}: no [models.NAME] table")
    if len(models_table) > MAX_MODELS:
        raise CatalogError(f"{where}: {len(models_table)} models; at most {MAX_MODELS}")
    models = tuple(_model(name, entry, settings, where, inherit, base) for name, entry in models_table.items())
    versions = [version for model in models for version in model.versions]
    if len(versions) > 1 and any(shares_engine(v.settings) for v in versions):
        raise CatalogError(
            f"{where}: the shared torch engine (GATEWAY_TORCH_ENGINE=shared) serves one model version; "
            "give several models torch_engine per-worker, or another backend"
        )
    default = table.get("default", models[0].name)
    if not isinstance(default, str) or default not in models_table:
        raise CatalogError(f"{where}: default {default!r} is not one of the models ({', '.join(models_table)})")
    return Catalog(models, default, discovery, table, base=base)


def _discovery(entry: Any, settings: Settings, where: str) -> Discovery | None:
    if entry is None:
        return None
    here = f"{where}: [triton]"
    if not isinstance(entry, dict):
        raise CatalogError(f"{here}: expected a table")
    _known(entry, {"url", "protocol", "profile", "share"}, here)
    url, protocol = entry.get("url"), entry.get("protocol", "grpc")
    if not isinstance(url, str) or not url.strip() or any(c.isspace() for c in url) or "/" in url:
        raise CatalogError(f"{here}: url must be Triton's host:port")
    if protocol not in ("grpc", "http"):
        raise CatalogError(f"{here}: protocol must be grpc or http")
    profile = get_profile_named(entry.get("profile", settings.model), here)
    share = _number(entry.get("share", 1), f"{here}: share", least=MIN_SHARE)
    return Discovery(url, protocol, profile.name, share)


def _model(name: str, entry: Any, settings: Settings, where: str, inherit: bool, base: Path) -> ModelSpec:
    here = where if inherit else f"{where}: model {name!r}"  # the one model of GATEWAY_MODEL: the setting says it
    if not NAME.fullmatch(name):
        raise CatalogError(f"{here}: a name is 1-64 of a-z 0-9 _ . - (starting with a letter or digit)")
    if not isinstance(entry, dict):
        raise CatalogError(f"{here}: expected a table")
    _known(entry, MODEL_KEYS, here)
    share = _number(entry.get("share", 1), f"{here}: share", least=MIN_SHARE)
    sticky = entry.get("sticky", False)
    if not isinstance(sticky, bool):
        raise CatalogError(f"{here}: sticky must be true or false")
    common = {key: entry[key] for key in ModelSettings.model_fields if key in entry}
    declared = {key: entry[key] for key in DECLARED_KEYS if key in entry}
    profile_name = entry.get("profile", name)
    versions_table = entry.get("versions")
    explicit = versions_table is not None
    if versions_table is None:
        versions_table = {DECLARED_VERSION if declared else get_profile_named(profile_name, here).version: {}}
    if not isinstance(versions_table, dict) or not versions_table:
        raise CatalogError(f"{here}: versions must be a table of [models.{name}.versions.N] tables")
    if len(versions_table) > MAX_VERSIONS:
        raise CatalogError(f"{here}: {len(versions_table)} versions; at most {MAX_VERSIONS}")
    versions = []
    for version, version_entry in versions_table.items():
        there = here if inherit else f"{here} version {version!r}"
        if not VERSION.fullmatch(version):
            raise CatalogError(f"{there}: a version is a positive integer, without leading zeros")
        if not isinstance(version_entry, dict):
            raise CatalogError(f"{there}: expected a table")
        _known(version_entry, VERSION_KEYS, there)
        own = {key: version_entry[key] for key in ModelSettings.model_fields if key in version_entry}
        keys = declared | {key: version_entry[key] for key in DECLARED_KEYS if key in version_entry}
        if keys and ("profile" in entry or "profile" in version_entry):
            raise CatalogError(
                f"{there}: profile: a model is a built-in profile or a declared one ({', '.join(sorted(keys))}), "
                "not both"
            )
        traffic = _number(version_entry.get("traffic", 1), f"{there}: traffic", least=0.0)
        defaults: dict[str, Any] = (
            {}
            if inherit
            else {"model_weights": None, "triton_model": name, "triton_model_version": version if explicit else ""}
        )
        model_settings = _model_settings(settings, defaults | common | own, there)
        if keys:
            merged = applied(settings, model_settings, name)
            profile = _declared(keys, name, version, merged, there, base)
        else:
            profile = get_profile_named(version_entry.get("profile", profile_name), there)
            merged = applied(settings, model_settings, profile.name)
        _check_backend(merged, profile, "backend" in own or "backend" in common, there)
        memory = version_entry.get("memory", entry.get("memory"))
        if memory is not None and (type(memory) is not int or not 0 < memory <= MAX_INT):
            raise CatalogError(f"{there}: memory must be a whole number of bytes above 0")
        _check_budget(merged, memory, there)
        versions.append(VersionSpec(version, profile, model_settings, settings, traffic, memory))
    if not any(v.traffic > 0 for v in versions):
        raise CatalogError(f"{here}: every version has traffic 0; at least one must take requests")
    return ModelSpec(name, tuple(sorted(versions, key=lambda v: int(v.version))), share, sticky)


def _declared(
    keys: dict[str, Any], name: str, version: str, settings: Settings, where: str, base: Path
) -> ModelProfile:
    """A declared model's profile: its keys checked, then its file read and checked against them
    (a model already in the user's Triton, without ``path``: what Triton says, asked now)."""
    from service.models.reading import complete  # reads ONNX files: imported where a model is declared

    if "path" not in keys and not capabilities_of(settings).on_triton:
        raise CatalogError(
            f'{where}: path: a declared model needs its file (path = "model.onnx"), or backend = "triton" for a '
            "model already in your Triton (triton_model names it)"
        )
    try:
        declaration = parse_declaration(keys, where, base=base, root=settings.models_root)
        if declaration.path is None:
            from service.backends.triton_declared import complete_on_triton

            return complete_on_triton(declaration, settings, name=name, version=version)
        return complete(declaration, name=name, version=version, max_batch_size=settings.max_batch_size)
    except DeclarationError as exc:
        raise CatalogError(str(exc)) from None


def _check_budget(settings: Settings, memory: int | None, where: str) -> None:
    """Under ``model_memory_budget``: an in-process version the budget can never hold, or whose
    memory cannot be estimated (the torch backend builds no model file), is refused at start."""
    budget = settings.model_memory_budget
    if not budget or not capabilities_of(settings).in_budget:
        return
    if (problem := budget_problem(settings, memory)) is not None:
        raise CatalogError(f"{where}: {problem}")
    if memory is not None and memory > budget:
        raise CatalogError(
            f"{where}: its memory ({memory >> 20} MB) is over GATEWAY_MODEL_MEMORY_BUDGET ({budget >> 20} MB): "
            "it could never load"
        )


def get_profile_named(name: Any, where: str) -> ModelProfile:
    """The profile ``name`` given as the ``profile`` key at ``where``; an error names the key."""
    if not isinstance(name, str):
        raise CatalogError(f"{where}: profile: must be a string")
    try:
        return get_profile(name)
    except ValueError as exc:
        raise CatalogError(
            f'{where}: profile: {exc}; or declare a model of your own: path = "model.onnx" and its labels '
            "(on Triton, without a path: its output = ...; see docs/own-models.md)"
        ) from None


def _known(entry: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")


def _number(value: Any, where: str, *, least: float) -> float:
    """A weight: a finite number from ``least`` (0: none; above 0: at least that) to 1,000,000."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1_000_000:
        raise CatalogError(f"{where} must be a number from {least:g} to 1000000")
    if least and value < least:
        raise CatalogError(f"{where} must be at least {least:g}")
    return float(value)


def _model_settings(settings: Settings, given: dict[str, Any], where: str) -> ModelSettings:
    """A version's own settings: what its tables give over the gateway's values, checked as one
    ``ModelSettings`` (each value by the setting's own rules: its type, bounds, no inf or nan, within
    64 bits), and the cross-checks with the gateway's settings that concern them."""
    try:
        own = ModelSettings.model_validate(ModelSettings.of(settings).model_dump() | given)
    except ValidationError as exc:
        problems: dict[str, list[str]] = {}
        for error in exc.errors(include_url=False, include_input=False):
            key = str(error["loc"][0]) if error["loc"] else "?"
            problems.setdefault(key, []).append(error["msg"].removeprefix("Value error, "))
        said = "; ".join(f"{key}: {'; '.join(messages)}" for key, messages in problems.items())
        raise CatalogError(f"{where}: {said}") from None
    if own.max_queue_size < settings.max_images_per_request:
        raise CatalogError(f"{where}: max_queue_size must be at least max_images_per_request")
    if settings.worker_prefetch > own.max_queue_size:
        raise CatalogError(f"{where}: max_queue_size must be at least worker_prefetch (a worker's batcher holds them)")
    return own


def applied(settings: Settings, own: ModelSettings, model: str) -> Settings:
    """The gateway's ``settings`` with a version's ``own`` applied, serving ``model`` (its profile's
    name): what the builders of a backend and a batcher read."""
    return settings.model_copy(update={"model": model, **dict(own)})


def _check_backend(settings: Settings, profile: ModelProfile, own: bool, where: str) -> None:
    """Whether the version's backend can run its model (``own``: the file names the backend)."""
    which = f"{where}: backend:" if own else f"{where}:"  # the file's, or the gateway's setting
    if (problem := run_problem(settings, profile, own=own)) is not None:
        raise CatalogError(f"{which} {problem}")
