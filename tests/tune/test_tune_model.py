"""``gateway tune --served-model``: with several models, one is tuned alone, as its version taking
the most traffic runs (its own settings from the models file), not the whole catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.settings import Settings
from service.tune.command import served_model_env

MODELS = """
default = "products"
[models.products]
profile = "efficientnet-lite0"
backend = "fake"
fake_delay = 0.01
max_batch_size = 32
[models.products.versions.1]
traffic = 10
[models.products.versions.2]
traffic = 90
profile = "trivial"
[models.moderation]
profile = "trivial"
"""


def test_the_model_is_tuned_alone_on_its_own_settings(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(MODELS)
    name, env = served_model_env(Settings(models_file=path), None)  # type: ignore[misc]
    assert name == "products"
    assert env == {
        "GATEWAY_MODELS_FILE": "",
        "GATEWAY_MODELS": "",
        "GATEWAY_MODEL": "trivial",  # version 2 takes the most traffic
        "GATEWAY_BACKEND": "fake",
        "GATEWAY_FAKE_DELAY": "0.01",
        "GATEWAY_TRITON_MODEL": "products",
        "GATEWAY_TRITON_MODEL_VERSION": "2",
    }  # max_batch_size is the search's to choose
    other = served_model_env(Settings(models_file=path), "moderation")
    assert other is not None
    assert other[1]["GATEWAY_MODEL"] == "trivial"
    assert "GATEWAY_BACKEND" not in other[1]  # the gateway's own: embedded
    with pytest.raises(SystemExit, match="no model 'nope'; served: products, moderation"):
        served_model_env(Settings(models_file=path), "nope")
    assert served_model_env(Settings(), None) is None
