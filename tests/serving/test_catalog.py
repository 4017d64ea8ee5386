"""The models setting and file: what they serve, and every wrong entry refused at start with the
model, the version and the key named; a reload that changes only weights is applied, any other
change refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.models.declaration import DECLARED_KEYS
from service.serving.catalog import CatalogError, load_catalog, read_models_file
from service.serving.discovery import with_discovered
from service.serving.reload import reread
from service.settings import Settings
from service.settings.model import ModelSettings

TWO = """
default = "shop"
[models.shop]
profile = "efficientnet-lite0"
share = 3
max_batch_size = 32
[models.shop.versions.1]
traffic = 90
[models.shop.versions.2]
profile = "resnet50"
traffic = 10
max_delay = 0.002
[models.moderation]
profile = "trivial"
backend = "fake"
"""


SHOP = "[models.shop]\nprofile = 'trivial'\n"
RESNET = "[models.shop]\nprofile = 'resnet50'\n"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_a_models_file_gives_each_version_its_settings(tmp_path: Path) -> None:
    catalog = load_catalog(Settings(models_file=_file(tmp_path, TWO), max_delay=0.01))
    assert catalog.default == "shop"
    shop, moderation = catalog.models
    assert (shop.share, [v.version for v in shop.versions]) == (3.0, ["1", "2"])
    one, two = shop.versions
    assert (one.profile.name, one.settings.max_batch_size, one.settings.max_delay, one.traffic) == (
        "efficientnet-lite0",
        32,
        0.01,
        90.0,
    )
    assert (two.profile.name, two.settings.max_batch_size, two.settings.max_delay) == ("resnet50", 32, 0.002)
    assert (moderation.versions[0].settings.backend, moderation.share) == ("fake", 1.0)


def test_without_a_file_the_models_setting_or_the_model_serves() -> None:
    assert [m.name for m in load_catalog(Settings(models="trivial, resnet50")).models] == ["trivial", "resnet50"]
    alone = load_catalog(Settings(model="trivial"))
    assert (alone.default, [v.version for v in alone.models[0].versions]) == ("trivial", ["1"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[models.A]\n", "model 'A': a name is 1-64 of a-z 0-9"),
        ('[models."../x"]\n', "a name is 1-64"),
        (
            "[models.shop]\nprofile = 'vgg'\n",
            "model 'shop': profile: unknown profile 'vgg'; known: efficientnet-lite0,",
        ),
        (
            "[models.shop.versions.1]\nprofile = 'vgg19'\n",
            "models.toml: model 'shop' version '1': profile: unknown profile 'vgg19'; known: efficientnet-lite0,",
        ),
        ("[models.shop]\nprofile = 3\n", "profile: must be a string"),
        (f"{SHOP}max_batch_size = 0\n", "model 'shop' version '1': max_batch_size: Input should be greater"),
        (f"{SHOP}max_batch_size = 'many'\n", "max_batch_size: Input should be a valid integer"),
        (f"{SHOP}backend = 'tensorflow'\n", "backend: Input should be 'embedded'"),
        (f"{SHOP}max_delay = inf\n", "max_delay: Input should be a finite number"),
        (f"{SHOP}max_queue_size = 1\n", "max_queue_size must be at least max_images_per_request"),
        ("[models.shop]\nrequest_timeout = 1\n", "unknown key(s) ['request_timeout']"),
        ("[models.shop]\nshare = 0\n", "share must be at least 0.001"),
        (
            "[models.shop]\nprofile = 'trivial'\nbackend = 'triton'\ntriton_url = 'localhost:99999'\n",
            "triton_url: 'localhost:99999' is not host:port",
        ),
        ("[models.shop]\nshare = -1\n", "share must be a number from 0"),
        ("[models.shop]\nshare = true\n", "share must be a number"),
        ("[models.shop]\nshare = nan\n", "share must be a number"),
        ("[models.shop]\nsticky = 'yes'\n", "sticky must be true or false"),
        ("[models.shop.versions.0]\n", "version '0': a version is a positive integer"),
        ("[models.shop.versions.01]\n", "version '01': a version is a positive integer"),
        ("[models.shop.versions.v2]\n", "a version is a positive integer"),
        (f"{SHOP}[models.shop.versions.1]\ntraffic = 0\n", "every version has traffic 0"),
        ("[models.shop.versions.1]\nbogus = 1\n", "version '1': unknown key(s) ['bogus']"),
        ("[models.shop]\nversions = 3\n", "versions must be a table"),
        (f"default = 'other'\n{SHOP}", "default 'other' is not one of the models (shop)"),
        ("models = 1\n", "no [models.NAME] table"),
        ("nonsense = 1\n[models.shop]\n", "unknown key(s) ['nonsense']"),
        ("\n".join(f"[models.m{i}]\nprofile = 'trivial'" for i in range(33)), "33 models; at most 32"),
        ("[models.shop]\n" + "".join(f"[models.shop.versions.{i}]\n" for i in range(1, 10)), "9 versions; at most 8"),
    ],
)
def test_a_wrong_models_file_is_refused_naming_where(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(CatalogError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_catalog(Settings(models_file=_file(tmp_path, text)))


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"[models\n", "is not valid TOML"), (b"\xff\xfe", "is not UTF-8"), (b"#" * (1024 * 1024 + 1), "over")],
)
def test_an_unreadable_models_file_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_bytes(content)
    with pytest.raises(CatalogError, match=message):
        read_models_file(path)
    with pytest.raises(CatalogError, match="No such file"):
        read_models_file(tmp_path / "missing.toml")
    with pytest.raises(CatalogError, match=r"is not a regular file|Is a directory"):
        read_models_file(tmp_path)


def test_the_models_setting_names_each_model_once() -> None:
    with pytest.raises(CatalogError, match="names a model twice"):
        load_catalog(Settings(models="trivial,trivial"))


def test_a_reload_reads_weights_and_settings(tmp_path: Path) -> None:
    settings = Settings(models_file=_file(tmp_path, TWO))
    catalog = load_catalog(settings)
    table = read_models_file(settings.models_file)  # type: ignore[arg-type]
    table["models"]["shop"]["versions"]["2"]["traffic"] = 50
    table["models"]["shop"]["share"] = 1
    reloaded = reread(catalog, table, settings, "reload")
    assert [v.traffic for v in reloaded.models[0].versions] == [90.0, 50.0]
    assert reloaded.models[0].share == 1.0
    table["models"]["shop"]["max_batch_size"] = 8
    assert reread(catalog, table, settings, "reload").models[0].versions[0].settings.max_batch_size == 8
    table["models"]["shop"]["max_batch_size"] = 0
    with pytest.raises(CatalogError, match="max_batch_size"):
        reread(catalog, table, settings, "reload")


def test_a_reload_that_changes_a_versions_memory_reads_it(tmp_path: Path) -> None:
    """A version's memory is part of what it runs with: a reload that changes it replaces the
    version (``service.serving.changes``), so that the loader counts the new value."""
    settings = Settings(models_file=_file(tmp_path, TWO))
    catalog = load_catalog(settings)
    table = read_models_file(settings.models_file)  # type: ignore[arg-type]
    table["models"]["shop"]["versions"]["2"]["memory"] = 64 << 20
    assert reread(catalog, table, settings, "reload").models[0].versions[1].memory == 64 << 20


def test_gateway_serve_refuses_a_bad_models_file_by_name(tmp_path: Path) -> None:
    path = _file(tmp_path, f"{SHOP}max_batch_size = 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--models-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "model 'shop' version '1': max_batch_size: Input should be greater than or equal to 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_one_model_keeps_the_gateways_settings_and_a_catalogs_models_take_only_their_own(
    tmp_path: Path,
) -> None:
    """``GATEWAY_MODEL`` alone is served as before (its Triton version, its weights file); a model
    of ``GATEWAY_MODELS`` or of the file does not inherit another model's weights or Triton name."""
    weights = tmp_path / "resnet.pt"
    alone = Settings(
        model="resnet50", backend="triton", triton_model_version="3", triton_model="rn", model_weights=weights
    )
    version = load_catalog(alone).models[0].versions[0].settings
    assert (version.triton_model_version, version.triton_model, version.model_weights) == ("3", "rn", weights)
    several = load_catalog(alone.model_copy(update={"models": "resnet50,trivial"}))
    for model in several.models:
        settings = model.versions[0].settings
        assert (settings.model_weights, settings.triton_model, settings.triton_model_version) == (None, model.name, "")
    text = f"{SHOP}[models.shop.versions.2]\nmodel_weights = '{weights}'\n"
    (two,) = load_catalog(Settings(models_file=_file(tmp_path, text), backend="triton")).models[0].versions
    assert (two.settings.model_weights, two.settings.triton_model, two.settings.triton_model_version) == (
        weights,
        "shop",
        "2",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{SHOP}breaker_cooldown = inf\n", "breaker_cooldown: Input should be a finite number"),
        (f"{SHOP}fake_delay = nan\n", "fake_delay: Input should be a finite number"),
        (f"{SHOP}embedded_threads = {2**70}\n", "embedded_threads"),
        (f"{SHOP}share = 1e-9\n", "share must be at least 0.001"),
        (f"{RESNET}backend = 'torch'\nmemory = 1000\n[models.other]\nprofile = 'trivial'\n", "shared torch engine"),
        (f"{SHOP}memory = {200 << 20}\n", r"its memory \(200 MB\) is over GATEWAY_MODEL_MEMORY_BUDGET \(150 MB\)"),
        (
            f"{SHOP}[models.t]\nprofile = 'resnet50'\nbackend = 'torch'\n",
            "the torch backend's memory cannot be estimated",
        ),
    ],
)
def test_per_model_values_get_the_settings_own_checks(tmp_path: Path, text: str, message: str) -> None:
    settings = Settings(models_file=_file(tmp_path, text), torch_engine="shared", model_memory_budget=150 << 20)
    with pytest.raises(CatalogError, match=message):
        load_catalog(settings)


def test_an_empty_models_file_setting_means_none() -> None:
    assert Settings(models_file="").models_file is None  # type: ignore[arg-type]


def test_a_fifo_or_deep_nesting_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(CatalogError, match="is not a regular file"):
        read_models_file(fifo)
    deep = _file(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(CatalogError, match="is not valid TOML"):
        read_models_file(deep)


def test_a_reload_may_reorder_the_models(tmp_path: Path) -> None:
    settings = Settings(models_file=_file(tmp_path, TWO))
    catalog = load_catalog(settings)
    shop, moderation = TWO.split("[models.moderation]")
    head, shop = shop.split("\n[models.shop]")
    reordered = read_models_file(_file(tmp_path, f"{head}\n[models.moderation]{moderation}\n[models.shop]{shop}"))
    assert [m.name for m in reread(catalog, reordered, settings, "reload").models] == ["moderation", "shop"]


def test_models_found_in_tritons_index_join_the_files_own(tmp_path: Path) -> None:
    """What Triton's index lists: valid names are served (traffic on the highest READY version),
    a model the file serves already (by name or as its triton_model) is not served twice, odd names
    and versions are left out, and no more than 32 models in all."""
    text = (
        "[triton]\nurl = 'triton:8001'\nprofile = 'trivial'\nshare = 0.5\n"
        "[models.shop]\nprofile = 'trivial'\nbackend = 'triton'\ntriton_model = 'resnet'\n"
    )
    settings = Settings(models_file=_file(tmp_path, text))
    catalog = load_catalog(settings)
    found = [
        ("det", "2", "READY"),
        ("det", "3", "UNAVAILABLE"),
        ("det", "3", "UNAVAILABLE"),
        ("det", "v4", "READY"),
        ("resnet", "1", "READY"),
        ("shop", "1", "READY"),
        ("Bad/Name", "1", "READY"),
        ("x" * 65, "1", "READY"),
        ("cold", "", "UNAVAILABLE"),
        *((f"m{i:02d}", "1", "READY") for i in range(40)),
    ]
    grown, skipped = with_discovered(catalog, found, settings)
    names = [m.name for m in grown.models]
    assert names[:3] == ["shop", "cold", "det"]
    assert len(names) == 32
    assert "resnet" not in names
    det = grown.model("det")
    assert det is not None
    assert [(v.version, v.traffic, v.settings.triton_model_version) for v in det.versions] == [
        ("2", 1.0, "2"),
        ("3", 0.0, "3"),
    ]
    assert (det.share, det.versions[0].settings.triton_model, det.versions[0].settings.triton_url) == (
        0.5,
        "det",
        "triton:8001",
    )
    cold = grown.model("cold")
    assert cold is not None
    assert [(v.version, v.settings.triton_model_version) for v in cold.versions] == [("1", "")]
    assert "Bad/Name" in skipped
    assert "x" * 65 in skipped
    assert len([name for name in skipped if name.startswith("m")]) == 40 - 29
    table = read_models_file(settings.models_file)  # type: ignore[arg-type]
    reloaded = reread(grown, table, settings, "reload")  # the found models stay
    assert [m.name for m in reloaded.models] == names


def test_a_versions_settings_are_checked_as_one_model_settings(tmp_path: Path) -> None:
    """A version's per-model keys, its model's under them, are validated together as one
    ``ModelSettings`` with the settings' own rules (``torch_device`` too, which a per-key check
    skipped): the error names model and version and every bad key, in the settings' order."""
    text = f"{SHOP}max_batch_size = 0\n[models.shop.versions.3]\ntorch_device = 'tpu'\nmax_delay = -1\n"
    with pytest.raises(CatalogError) as caught:
        load_catalog(Settings(models_file=_file(tmp_path, text)))
    assert str(caught.value) == (
        f"{tmp_path / 'models.toml'}: model 'shop' version '3': torch_device: 'tpu' is not cpu, cuda or cuda:N; "
        "max_batch_size: Input should be greater than or equal to 1; "
        "max_delay: Input should be greater than or equal to 0"
    )


def test_an_unknown_key_lists_the_model_settings_fields(tmp_path: Path) -> None:
    """The per-model keys a table may hold are ``ModelSettings``' fields, named when a key is not one."""
    with pytest.raises(CatalogError, match=r"unknown key\(s\) \['request_timeout'\]; allowed: ") as caught:
        load_catalog(Settings(models_file=_file(tmp_path, f"{SHOP}request_timeout = 1\n")))
    allowed = set(str(caught.value).partition("allowed: ")[2].split(", "))
    assert set(ModelSettings.model_fields) <= allowed
    gateway_wide = set(Settings.model_fields) - set(ModelSettings.model_fields) - set(DECLARED_KEYS)
    assert "request_timeout" in gateway_wide
    assert not allowed & gateway_wide


def test_a_version_holds_its_model_settings_and_reads_the_rest_from_the_gateway(tmp_path: Path) -> None:
    """``VersionSpec.own`` is the version's ``ModelSettings`` (its table over its model's over the
    gateway's), declared once with the gateway's fields; what the whole process shares is the
    gateway's ``Settings``, which a ``ModelSettings`` refuses to hold."""
    settings = Settings(models_file=_file(tmp_path, TWO), max_delay=0.01, request_timeout=3.0)
    two = load_catalog(settings).models[0].versions[1]
    assert isinstance(two.own, ModelSettings)
    assert (two.own.max_batch_size, two.own.max_delay, two.own.triton_model, two.gateway) == (
        32,
        0.002,
        "shop",
        settings,
    )
    assert (two.settings.model, two.settings.max_batch_size, two.settings.request_timeout) == ("resnet50", 32, 3.0)
    for name, field in ModelSettings.model_fields.items():
        assert field.description
        assert Settings.model_fields[name].description == field.description
        assert Settings.model_fields[name].metadata == field.metadata
    with pytest.raises(ValidationError, match="request_timeout"):
        ModelSettings(request_timeout=1.0)  # type: ignore[call-arg]
