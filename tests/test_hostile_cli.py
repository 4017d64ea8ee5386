"""Hostile and careless input to the command line and the settings, run as a user runs it: every
command's --help works, and a bad GATEWAY_* value or flag ends the process with a message naming
the setting and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cli import build_parser
from service.settings.keys import MAX_KEYS_FILE_BYTES
from service.settings.values import setting_name

RUN_FOR = 60.0
"""Seconds a command may take before it counts as hanging (a gateway serving when it should refuse)."""


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command line the parser knows, as the words that name it (the top level first)."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m service ARGS`` in a real process (killed if it outlives RUN_FOR)."""
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_FOR,
    )


def test_every_command_has_working_help() -> None:
    """``--help`` of every command and subcommand the parser knows (found from the parser, not a
    list kept by hand) exits 0 and prints its usage, run as ``python -m service ... --help``."""
    commands = list(_commands(build_parser()))
    assert ("serve",) in commands
    assert ("models", "fetch") in commands
    processes = {
        words: subprocess.Popen(
            [sys.executable, "-m", "service", *words, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for words in commands
    }
    failures = []
    for words, process in processes.items():
        out, err = process.communicate(timeout=RUN_FOR)
        if process.returncode != 0 or not out.startswith(f"usage: {' '.join(('gateway', *words))}"):
            failures.append(f"gateway {' '.join(words)} --help: exit {process.returncode}\n{out[:200]}{err[-500:]}")
    assert not failures, "\n\n".join(failures)


def test_a_settings_help_shows_its_percent_sign() -> None:
    """A setting whose description says "99 %" shows it as written in ``--help`` (argparse reads %
    as a format)."""
    from pydantic.fields import FieldInfo

    from service.cli.flags import Parser, flag_help

    parser = Parser(prog="gateway test")
    parser.add_argument(
        "--share", help=flag_help("share", FieldInfo(default=None, description="Agree on 99 % of the photos."))
    )
    assert "Agree on 99 % of the photos [default: unset; env GATEWAY_SHARE]" in " ".join(parser.format_help().split())


BAD_VALUES = [
    ("GATEWAY_MAX_BODY_BYTES", "-5", "max_body_bytes"),
    ("GATEWAY_MAX_BODY_BYTES", "", "max_body_bytes"),
    ("GATEWAY_PORT", "abc", "port"),
    ("GATEWAY_PORT", "70000", "port"),
    ("GATEWAY_PORT", "1e3", "port"),
    ("GATEWAY_WORKERS", "0", "workers"),
    ("GATEWAY_HEADER_TIMEOUT", "nan", "header_timeout"),
    ("GATEWAY_REQUEST_TIMEOUT", "inf", "request_timeout"),
    ("GATEWAY_BODY_TIMEOUT", "1e400", "body_timeout"),
    ("GATEWAY_MAX_DELAY", "-0.1", "max_delay"),
    ("GATEWAY_MAX_CONNECTIONS", "9" * 30, "max_connections"),
    ("GATEWAY_MAX_QUEUE_SIZE", str(2**63), "max_queue_size"),
    ("GATEWAY_ACCESS_LOG", "maybe", "access_log"),
    ("GATEWAY_LOG_LEVEL", "loud", "log_level"),
    ("GATEWAY_LOG_FORMAT", "xml", "log_format"),
    ("GATEWAY_URL_ALLOWLIST", "300.1.1.1/40", "url_allowlist"),
    ("GATEWAY_WEBHOOK_RETRY_DELAYS", "soon", "webhook_retry_delays"),
    # keys set that hold none served every route without authentication, without a word
    ("GATEWAY_API_KEYS", ",", "api_keys"),
    ("GATEWAY_API_KEYS", " , # none", "api_keys"),
    # a port past 65535 reached another port (gRPC takes it modulo 65536); a broken address passed
    # for an unreachable Triton
    ("GATEWAY_TRITON_URL", "localhost:99999", "triton_url"),
    ("GATEWAY_TRITON_URL", "http://[::1", "triton_url"),
    ("GATEWAY_TRITON_URL", "triton", "triton_url"),
    ("GATEWAY_TRITON_URL", "http://triton:8001", "triton_url"),
]


@pytest.mark.parametrize(("variable", "value", "setting"), BAD_VALUES, ids=[f"{v}={x[:12]}" for v, x, _ in BAD_VALUES])
def test_a_bad_environment_value_is_refused_by_name(variable: str, value: str, setting: str) -> None:
    """``gateway serve`` with a bad GATEWAY_* value (negative, empty, not a number, inf or nan,
    beyond 64 bits, not one of the choices) exits non-zero at once with a message that names the
    setting, and no traceback."""
    done = _gateway("serve", "--backend", "fake", env={variable: value})
    assert done.returncode != 0
    assert "gateway: invalid settings" in done.stderr
    assert setting_name(setting) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["engine", "--socket", "x"], ["models", "list"]])
def test_a_bad_flag_value_is_refused_by_name(command: list[str]) -> None:
    """The same settings as flags (``--max-body-bytes -5``, ``--header-timeout inf``) on several
    commands: a non-zero exit with a message naming each setting, and no traceback."""
    done = _gateway(*command, "--max-body-bytes", "-5", "--header-timeout", "inf")
    assert done.returncode != 0
    assert "--max-body-bytes / GATEWAY_MAX_BODY_BYTES: " in done.stderr
    assert "--header-timeout / GATEWAY_HEADER_TIMEOUT: " in done.stderr
    assert "Traceback" not in done.stderr


def test_an_api_keys_file_that_holds_no_key_is_refused(tmp_path: Path) -> None:
    """A keys file of comments and blank lines (a template's placeholder) is refused at start: it
    served every route without authentication, without a word."""
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\n\n")
    done = _gateway("serve", "--backend", "fake", env={"GATEWAY_API_KEYS_FILE": str(keys)})
    assert done.returncode != 0
    assert f"{setting_name('api_keys_file')} hold no API key" in done.stderr
    assert "Traceback" not in done.stderr


BAD_COMMAND_NUMBERS = [
    (["ingest", "x", "--out", "o.jsonl", "--connect-timeout", "nan"], "--connect-timeout"),
    (["ingest", "x", "--out", "o.jsonl", "--connect-timeout", "-1"], "--connect-timeout"),
    (["ingest", "x", "--out", "o.jsonl", "--max-outstanding", "0"], "--max-outstanding"),
    (["ingest", "x", "--out", "o.jsonl", "--max-outstanding", "70000"], "--max-outstanding"),
    (["ingest", "x", "--out", "o.jsonl", "--resend-after", "nan"], "--resend-after"),
    (["alive", "--max-age", "nan"], "--max-age"),
    (["alive", "--max-age", "inf"], "--max-age"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_COMMAND_NUMBERS, ids=[" ".join(a[-2:]) for a, _ in BAD_COMMAND_NUMBERS])
def test_a_commands_own_number_out_of_range_is_refused_by_name(args: list[str], flag: str, tmp_path: Path) -> None:
    """A command's own numeric flag that is nan, inf or out of its range ends the command at once
    with exit status 2 naming the flag (``--connect-timeout nan`` was a traceback, ``--max-outstanding
    0`` a run that hung publishing nothing, ``--resend-after nan`` one that never resent, ``alive
    --max-age nan`` a probe that passed a heartbeat hours old)."""
    done = subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=RUN_FOR, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}:" in done.stderr
    assert "Traceback" not in done.stderr


def _keys_file(kind: str, tmp_path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(tmp_path / "keys")
        return tmp_path / "keys"
    if kind == "oversized":
        path = tmp_path / "keys"
        with path.open("wb") as file:
            file.truncate(MAX_KEYS_FILE_BYTES + 1)  # sparse: no disk used
        return path
    return {"device": Path("/dev/zero"), "directory": tmp_path, "missing": tmp_path / "none"}[kind]


@pytest.mark.parametrize("kind", ["device", "fifo", "oversized", "directory", "missing"])
def test_an_api_keys_file_that_is_not_a_small_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    """GATEWAY_API_KEYS_FILE naming /dev/zero (read for ever, filling memory), a FIFO no one writes
    (blocked for ever), a file over MAX_KEYS_FILE_BYTES, a directory or nothing: ``gateway serve``
    exits non-zero at once, naming the setting, with no traceback."""
    done = _gateway("serve", "--backend", "fake", env={"GATEWAY_API_KEYS_FILE": str(_keys_file(kind, tmp_path))})
    assert done.returncode != 0
    assert "gateway: invalid settings" in done.stderr
    assert "--api-keys-file / GATEWAY_API_KEYS_FILE: " in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("host", ["", " ", " 127.0.0.1"], ids=["empty", "blank", "padded"])
def test_an_empty_host_is_refused(host: str) -> None:
    """``--host ''`` (and GATEWAY_HOST=) would bind every interface (asyncio reads '' as all of
    them): refused by name instead of publishing the gateway."""
    for done in (
        _gateway("serve", "--backend", "fake", "--host", host),
        _gateway("serve", "--backend", "fake", env={"GATEWAY_HOST": host}),
    ):
        assert done.returncode != 0
        assert "gateway: invalid settings" in done.stderr
        assert "host" in done.stderr


TORCH_TOML = "[models.shop]\nprofile = 'efficientnet-lite0'\nbackend = 'torch'\n"

BAD_COMBINATIONS = [
    (["--backend", "torch"], ["--backend / GATEWAY_BACKEND", "--model / GATEWAY_MODEL", "resnet50 only"]),
    (
        ["--backend", "torch", "--models", "trivial,resnet50"],
        ["--backend / GATEWAY_BACKEND", "--models / GATEWAY_MODELS"],
    ),
    (["--models-file", "{torch.toml}"], ["models.toml: model 'shop' version '1': backend: efficientnet-lite0 cannot"]),
    (["--backend", "torch", "--model", "resnet50", "--torch-device", "tpu"], ["--torch-device / GATEWAY_TORCH_DEVICE"]),
    (
        ["--backend", "torch", "--model", "resnet50", "--model-memory-budget", "100000000"],
        ["--model-memory-budget / GATEWAY_MODEL_MEMORY_BUDGET", "--models-file / GATEWAY_MODELS_FILE"],
    ),
    (["--decoder", "nvjpeg", "--torch-device", "cpu"], ["--decoder / GATEWAY_DECODER", "--torch-device / GATEWAY_"]),
    (["--max-queue-size", "8"], ["--max-queue-size / GATEWAY_MAX_QUEUE_SIZE (8) must be at least --max-images-per"]),
    (["--max-image-bytes", "2000000", "--max-decode-bytes", "1000000"], ["--max-decode-bytes / GATEWAY_MAX_DECODE_"]),
    (["--max-body-bytes", "2048", "--max-buffered-body-bytes", "1024"], ["--max-buffered-body-bytes / GATEWAY_"]),
    (["--worker-prefetch", "300"], ["(256) must be at least --worker-prefetch / GATEWAY_WORKER_PREFETCH (300)"]),
    (["--webhook-retry-delays", ","], ["--webhook-retry-delays / GATEWAY_WEBHOOK_RETRY_DELAYS: "]),
    (["--url-allowlist", "10.0.0.0/40"], ["--url-allowlist / GATEWAY_URL_ALLOWLIST: "]),
    (["--models-file", "{missing}"], ["--models-file / GATEWAY_MODELS_FILE: No such file or directory"]),
    (["--models-file", "{folder}"], ["--models-file / GATEWAY_MODELS_FILE: ", "is not a regular file"]),
    # on a host without that CUDA device: it started, logged a traceback and was never ready
    (["--backend", "torch", "--model", "resnet50", "--torch-device", "cuda:63"], ["GATEWAY_TORCH_DEVICE cuda:63: "]),
]


@pytest.mark.parametrize(("flags", "said"), BAD_COMBINATIONS, ids=[" ".join(f)[:40] for f, _ in BAD_COMBINATIONS])
def test_a_bad_combination_of_settings_is_refused_before_anything_starts(
    flags: list[str], said: list[str], tmp_path: Path
) -> None:
    """``gateway serve --backend torch`` with the default model (which the torch backend cannot run),
    a GPU decoder on the CPU, a device PyTorch does not know, bounds that contradict each other, a
    models file that is missing, a folder, or gives a model a backend that cannot run its profile:
    each ends ``gateway serve`` before the server or any model starts, with a message naming the
    flags and environment variables, and none of pydantic's field names, error codes or links."""
    (tmp_path / "models.toml").write_text(TORCH_TOML)
    paths = {"{torch.toml}": tmp_path / "models.toml", "{missing}": tmp_path / "none.toml", "{folder}": tmp_path}
    done = _gateway("serve", *(str(paths.get(flag, flag)) for flag in flags), "--port", "0")
    assert done.returncode == 1, done.stderr[-2000:]
    message = done.stderr.removeprefix("gateway: invalid settings:\n")
    assert message != done.stderr, done.stderr[-2000:]
    for words in said:
        assert words in message
    for pydantic in ("Traceback", "validation error for", "errors.pydantic.dev", "[type=", "Value error"):
        assert pydantic not in done.stderr
    assert "Started server process" not in done.stderr
    assert "startup" not in done.stderr
