"""What every command shares: its settings as flags, the settings read and checked before anything
starts, logging."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from service.settings import Settings
from service.settings.reference import explain
from service.settings.values import setting_name

STARTUP_FAILURE = 3
"""Exit status of a server whose start-up failed (uvicorn's)."""


def number(low: float, high: float, *, integer: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a flag's number: finite, within ``[low, high]`` (whole with
    ``integer``); anything else is argparse's usage error naming the flag and the range (``nan``
    and ``inf`` passed ``float`` and then disabled the check or the loop they set)."""
    kind = "a whole number" if integer else "a number"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not low <= value <= high:  # also false for nan
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind} from {low:g} to {high:g}")
        return value

    return parse


def load_settings(args: argparse.Namespace, *, serves: bool = False) -> Settings:
    """The settings of the environment and the flags, each checked, and the models they serve with
    them (profiles, backends, the models file; with ``serves``, whether this host can run each):
    any problem ends the command here, before anything starts, with a message naming the flags and
    variables."""
    overrides = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        sys.exit(f"gateway: invalid settings:\n{explain(exc)}")
    from service.models.profiles import PROFILES

    if settings.model not in PROFILES and settings.model_path is None:  # settings know no model table: a leaf
        known = ", ".join(PROFILES)
        sys.exit(
            f"gateway: invalid settings:\n{setting_name('model')}: unknown profile {settings.model!r}; known: {known}"
        )
    from service.serving.catalog import CatalogError, load_catalog

    try:
        catalog = load_catalog(settings)  # a bad models file fails here, by model, version and key
    except CatalogError as exc:
        sys.exit(f"gateway: invalid settings:\n{exc}")
    if serves:  # a command that runs the models: can this host run each as set?
        from service.backends.factory import host_problem

        for model in catalog.models:
            for version in model.versions:
                if (problem := host_problem(version.settings)) is not None:
                    where = f"model {model.name!r} version {version.version!r}: " if len(catalog.models) > 1 else ""
                    sys.exit(
                        f"gateway: invalid settings:\n{where}{setting_name('torch_device')} "
                        f"{version.settings.torch_device}: {problem}; use cpu, or a device this host has"
                    )
    return settings


def logging_config(settings: Settings) -> dict[str, Any]:
    """Configure the gateway's logging from its settings; uvicorn's ``log_config``."""
    from service.logs import configure_logging

    return configure_logging(settings.log_level, settings.log_format, settings.log_repeat_interval)
