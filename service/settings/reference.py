"""The settings as their users read them: a refusal of ``Settings`` explained by flag and
variable, and the settings reference (docs/settings.md's table), made from the fields' docstrings."""

from __future__ import annotations

from pydantic import SecretStr, ValidationError

from service.settings import Settings
from service.settings.values import setting_name


def explain(error: ValidationError) -> str:
    """A refusal of ``Settings`` as its user reads it: a line per problem, each naming the flag and
    the environment variable, without pydantic's field names, error codes or documentation links."""
    lines = []
    for problem in error.errors(include_url=False, include_input=False):
        message = problem["msg"].removeprefix("Value error, ")
        where = problem["loc"][0] if problem["loc"] else None
        if isinstance(where, str) and where in Settings.model_fields:
            message = f"{setting_name(where)}: {message}"
        elif where is not None:
            message = f"{where}: {message}"
        lines.append(message)
    return "\n".join(lines)


SHOWN_DEFAULTS = {
    "models_dir": "`$XDG_CACHE_HOME/inference-gateway/models`",
    "worker_heartbeat_file": "`$TMPDIR/gateway-worker.heartbeat`",
    "preprocess_workers": "two per usable CPU",
    "triton_model": "the `GATEWAY_MODEL` name",
}
"""Defaults the reference shows in words: those computed where the gateway runs."""


def reference() -> str:
    """The settings reference (docs/settings.md's table), made from the fields' docstrings:
    ``gateway settings`` prints it, and a test checks the page against it."""
    rows = ["| variable | default | what it changes |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if name in SHOWN_DEFAULTS:
            default = SHOWN_DEFAULTS[name]
        elif field.default is None:
            default = "unset"
        else:
            value = field.default.get_secret_value() if isinstance(field.default, SecretStr) else field.default
            value = str(value).lower() if isinstance(value, bool) else value
            default = f"`{value}`" if str(value) != "" else "empty"
        text = " ".join((field.description or "").split()).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `GATEWAY_{name.upper()}` | {default} | {text} |")
    return "\n".join(rows) + "\n"
