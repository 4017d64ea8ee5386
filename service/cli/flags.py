"""The settings as command-line flags: grouped by concern, only the groups a command uses, each flag
with its default, its environment variable and its unit; booleans as switches.

argparse stays (its argument groups and ``BooleanOptionalAction`` give all of this): the settings
are pydantic-settings fields whose validation, messages by flag and variable (``explain``) and
environment reading the commands already share, and pydantic-settings' own CLI parses every field
on every command, ungrouped, with its own messages. What a command's ``--help`` shows of a setting
is the first sentence of its description; docs/settings.md has the whole of it.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, NoReturn, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from service.settings import Settings
from service.settings.declared import DeclaredModelFields
from service.settings.fields import LimitsFields, OfflineFields, ServerFields
from service.settings.model import ModelFields
from service.settings.reference import SHOWN_DEFAULTS
from service.settings.values import ENV_PREFIX

GROUPS = {
    "server": "where the gateway listens and how many processes serve",
    "models": "what is served: the model, a models file, where models are kept",
    "a model of your own": "a model file declared on the command line, and how its images are prepared",
    "backends": "what runs the batches: ONNX Runtime, OpenVINO, Triton; a failing backend",
    "GPU": "the torch backend on a CUDA GPU: precision, graphs, a shared engine, the JPEG decoder",
    "batching": "how images are grouped into backend batches",
    "limits": "bounds on requests, bodies, images and time",
    "offline": "RabbitMQ, the workers, idempotent submits, webhooks",
    "security": "API keys and quotas, the admin key, what the gateway may fetch or call",
    "observability": "logs, traces and metrics",
}
"""The concerns the settings are grouped by, in the order ``--help`` shows them."""

_BY_NAME = {
    "models": {
        "model",
        "models",
        "models_file",
        "models_dir",
        "models_root",
        "model_weights",
        "model_memory_budget",
        "fair_sharing",
    },
    "GPU": {
        "torch_device",
        "torch_precision",
        "torch_cuda_graphs",
        "torch_compile",
        "torch_engine",
        "engine_socket",
        "engine_inflight_batches",
        "engine_start_attempts",
        "engine_down_limit",
        "torch_sync",
        "decoder",
    },
    "security": {
        "api_keys",
        "api_keys_file",
        "key_rate",
        "key_burst",
        "key_concurrency",
        "admin_key",
        "metrics_public",
        "url_inputs",
        "url_allow_http",
        "url_allowlist",
        "webhook_secret",
        "webhook_allow_http",
        "webhook_allowlist",
    },
    "observability": {
        "log_level",
        "access_log",
        "log_format",
        "log_repeat_interval",
        "tracing_endpoint",
        "tracing_service_name",
        "tracing_sample_ratio",
        "worker_metrics_port",
        "worker_metrics_ports",
        "readiness_interval",
    },
    "batching": {
        "max_batch_size",
        "max_delay",
        "batch_policy",
        "max_inflight_batches",
        "max_queue_size",
    },
    "limits": {"url_max_bytes", "url_timeout", "url_max_redirects", "idempotency_max_bytes", "jobs_cache_bytes"},
}
_BY_CLASS: tuple[tuple[type[BaseModel], str], ...] = (
    (ServerFields, "server"),
    (LimitsFields, "limits"),
    (OfflineFields, "offline"),
    (DeclaredModelFields, "a model of your own"),
    (ModelFields, "backends"),
)


def group_of(name: str) -> str:
    """The concern a setting belongs to."""
    for group, names in _BY_NAME.items():
        if name in names:
            return group
    for fields, group in _BY_CLASS:
        if name in fields.model_fields:
            return group
    return "backends"  # the serving fields: engines, decoders, the torch backend's own


_UNITS = (
    (re.compile(r"(_bytes|_memory_budget)$"), "bytes"),
    (re.compile(r"(timeout|_ttl|interval|_delay|_cooldown|_age|^engine_down_limit)$"), "seconds"),
    (re.compile(r"_ratio$"), "0 to 1"),
    (re.compile(r"^key_rate$"), "images per second"),
    (re.compile(r"^key_burst$"), "images"),
    (re.compile(r"(^max_batch_size|_images_per_request|_queue_size|^preprocess_workers|^workers)$"), ""),
)


def unit_of(name: str) -> str:
    """The unit a setting's number is in ("" where it is a count or not a number)."""
    if name == "webhook_retry_delays":
        return "seconds, comma-separated"
    for pattern, unit in _UNITS:
        if pattern.search(name):
            return unit
    return ""


def shown_default(name: str, field: FieldInfo) -> str:
    if name in SHOWN_DEFAULTS:
        return SHOWN_DEFAULTS[name].replace("`", "")
    if field.default is None:
        return "unset"
    value = field.default.get_secret_value() if isinstance(field.default, SecretStr) else field.default
    if isinstance(value, bool):
        return "on" if value else "off"
    return "empty" if str(value) == "" else str(value)


SUMMARY = 100
"""Characters of a description ``--help`` shows at most (two lines or so): docs/settings.md has it all."""


def summary(field: FieldInfo) -> str:
    """The description's first sentence in one line, cut at a clause near ``SUMMARY`` characters
    (``--help``'s; docs/settings.md has the rest), keeping what 0 means where it says so."""
    text = " ".join((field.description or "").split()).replace("``", "")
    first = re.split(r"(?<=[.;:])\s+(?=[A-Z(`])", text, maxsplit=1)[0].rstrip(".;:")
    if len(first) <= SUMMARY:
        return first
    head = first[:SUMMARY]
    cut = max(head.rfind("; "), head.rfind(", "), head.rfind(" ("), head.rfind(": "))
    if head[:cut].count("(") > head[:cut].count(")"):  # not inside a parenthesis
        cut = head[:cut].rfind(" (")
    if cut < SUMMARY // 2:
        cut = head.rfind(" ")
    shown = first[:cut].rstrip(" ,;:") + "..."
    if (zero := re.search(r"\((0[: ][^)]*)\)", first)) is not None and zero.group(0) not in shown:
        shown += f" ({re.split(r'[;,] ', zero.group(1), maxsplit=1)[0]})"  # what 0 means is kept
    return shown


def is_switch(field: FieldInfo) -> bool:
    return field.annotation is bool


def choices_of(field: FieldInfo) -> tuple[str, ...]:
    """A setting's values where it takes one of a few words (a ``Literal``, optional or not)."""
    annotation: Any = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
    if get_origin(annotation) is Literal:
        return tuple(str(choice) for choice in get_args(annotation))
    return ()


_METAVARS = {int: "N", float: "NUMBER", str: "TEXT", Path: "PATH", SecretStr: "SECRET"}


def metavar_of(name: str, field: FieldInfo) -> str:
    if choices := choices_of(field):
        return "{" + ",".join(choices) + "}"
    if unit := unit_of(name):
        return unit.split(",")[0].upper().replace(" ", "_")
    annotation: Any = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        annotation = next((a for a in get_args(annotation) if a is not type(None)), annotation)
    return _METAVARS.get(get_origin(annotation) or annotation, "VALUE")


def flag_help(name: str, field: FieldInfo) -> str:
    """What ``--help`` says of a setting: its summary, then its default, unit and variable."""
    facts = [f"default: {shown_default(name, field)}"]
    if unit := unit_of(name):
        facts.append(unit)
    facts.append(f"env {ENV_PREFIX}{name.upper()}")
    # argparse formats help with %: a description saying "99 % of" must not read as a format
    return f"{summary(field)} [{'; '.join(facts)}]".replace("%", "%%")


def add_setting_flags(
    parser: argparse.ArgumentParser, groups: tuple[str, ...] = tuple(GROUPS), skip: frozenset[str] = frozenset()
) -> None:
    """The settings of ``groups`` as flags of ``parser``, one argument group per concern; ``skip``:
    settings whose flag the command gives a meaning of its own. A flag not given is None: the
    environment or the default then decides (``load_settings``)."""
    sections = {group: parser.add_argument_group(f"{group} ({GROUPS[group]})") for group in groups}
    for name, field in Settings.model_fields.items():
        group = group_of(name)
        if name in skip or group not in sections:
            continue
        flag = f"--{name.replace('_', '-')}"
        if is_switch(field):
            sections[group].add_argument(
                flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=flag_help(name, field)
            )
        else:
            metavar = metavar_of(name, field)
            sections[group].add_argument(flag, dest=name, default=None, metavar=metavar, help=flag_help(name, field))


SWITCH_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0"})
"""Words an older command line gave a boolean flag as its value (``--url-inputs false``)."""


class Parser(argparse.ArgumentParser):
    """argparse, with a short usage line (the command, ``[options]``, its positional arguments), a
    usage error in two lines (the error, then where help is), no abbreviated flags (with every
    setting a flag, ``--max-batch`` matched one of several by luck), and a switch given a value
    (``--url-inputs false``, once the form) refused rather than read as a positional argument."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        for word, following in itertools.pairwise(words):
            if word == "--":
                break
            action = self._option_string_actions.get(word)
            if isinstance(action, argparse.BooleanOptionalAction) and following.lower() in SWITCH_WORDS:
                self.error(f"argument {word}: a switch takes no value ({following!r})")
        return super().parse_known_args(words, namespace)

    def format_usage(self) -> str:
        self._compact()
        return super().format_usage()

    def format_help(self) -> str:
        self._compact()
        return super().format_help()

    def _compact(self) -> None:
        if self.usage is not None:
            return
        optional = [a for a in self._actions if a.option_strings]
        if len(optional) <= 6:  # a small command: argparse's own usage is short and says more
            return
        words = []
        for action in self._actions:
            if action.option_strings:
                continue
            if isinstance(action, argparse._SubParsersAction):
                words.append("{" + ",".join(action.choices) + "} ...")
            else:
                word = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
                words.append(f"{word} [{word} ...]" if action.nargs in ("+", "*") else word)
        self.usage = " ".join(("%(prog)s [options]", *words))

    def error(self, message: str) -> NoReturn:
        """A setting's flag is named with its variable and what it takes (``--port / GATEWAY_PORT:
        expected one argument, N``); other errors, and a command's own flags, as argparse says them."""
        found = re.match(r"argument (--[a-z0-9-]+)(?:/--no-[a-z0-9-]+)?: (.*)", message, re.S)
        action = self._option_string_actions.get(found.group(1)) if found is not None else None
        if found is not None and action is not None and action.dest in Settings.model_fields:
            flag, name = found.group(1), action.dest
            field = Settings.model_fields[name]
            if is_switch(field):
                wanted = f"a switch: {flag} turns it on, --no-{flag[2:]} off"
            else:
                wanted = f"expected {metavar_of(name, field)}"
            message = f"{flag} / {ENV_PREFIX}{name.upper()}: {found.group(2)}; {wanted}"
        sys.stderr.write(f"{self.prog}: error: {message}\n(see: {self.prog} --help)\n")
        sys.exit(2)


def source_of(name: str, args: argparse.Namespace) -> str:
    """Where a setting's value comes from: a flag given on the command line (parsed: not None), the
    environment (its variable in any case, as pydantic-settings reads it), or the default."""
    import os

    if getattr(args, name, None) is not None:
        return "flag"
    variable = f"{ENV_PREFIX}{name.upper()}"
    if any(key.upper() == variable for key in os.environ):
        return "environment"
    return "default"


def effective(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(variable, value, source) of every setting a process given these flags and this environment
    would run with; source is ``flag``, ``environment`` or ``default`` (``source_of``); secrets, and
    the passwords of addresses, masked; a value the gateway works out (0: from other settings) with
    the one it uses."""
    from service.settings.values import redact, setting_name

    overrides = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    settings = Settings(**overrides)
    rows = []
    for name in Settings.model_fields:
        value: Any = getattr(settings, name)
        if isinstance(value, SecretStr):
            shown = "********" if value.get_secret_value() else ""
        elif isinstance(value, str) and "@" in value:  # an address with credentials (broker, collector)
            shown = ",".join(redact(url) for url in value.split(","))
        elif isinstance(value, bool):
            shown = "true" if value else "false"
        else:
            shown = "" if value is None else str(value)
        worked_out = getattr(settings, f"{name}_effective", None)
        if worked_out is not None and worked_out != value:
            shown = f"{shown} (in effect: {worked_out})"
        rows.append((setting_name(name).split(" / ")[1], shown, source_of(name, args)))
    return rows
