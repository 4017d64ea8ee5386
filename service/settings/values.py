"""What settings' values are and how they are named: a setting's flag and variable, the parsers
of values given as text, bounded reads of the files settings name. Imports nothing of the gateway's."""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from pathlib import Path
from urllib.parse import urlsplit

MAX_INT = 2**63 - 1
"""Largest integer a setting may hold."""
ENV_PREFIX = "GATEWAY_"


def setting_name(field: str) -> str:
    """A setting as its user names it, its flag and its environment variable (``--max-queue-size /
    GATEWAY_MAX_QUEUE_SIZE``): what every settings error says, never the field's name alone."""
    return f"--{field.replace('_', '-')} / {ENV_PREFIX}{field.upper()}"


def parse_delays(text: str) -> tuple[int, ...]:
    """``"1,5,30"`` (seconds) in milliseconds, each at least 1 ms."""
    try:
        delays = tuple(max(1, round(float(part) * 1000)) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"webhook_retry_delays: {text!r} is not a comma-separated list of seconds") from None
    if not delays:
        raise ValueError("webhook_retry_delays: at least one delay")
    return delays


WEBHOOK_SECRET_PREFIX = "whsec_"


def parse_secret(text: str) -> bytes:
    """The key of ``whsec_<base64>`` (the prefix optional, padding too, as the spec's libraries read it)."""
    raw = text.strip().removeprefix(WEBHOOK_SECRET_PREFIX)
    try:
        secret = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("webhook_secret must be base64, optionally after 'whsec_'") from None
    if len(secret) < 24:
        raise ValueError(f"webhook_secret holds {len(secret)} bytes; at least 24 (32 recommended)")
    return secret


TORCH_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,2})?")
"""A torch device the gateway takes."""
MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
"""A model's name (as ``service.serving.catalog`` checks it)."""
TRITON_MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")
"""A model's name in Triton's repository: a folder's name there (not ``.`` or ``..``)."""


def triton_model_name(value: str | None) -> str | None:
    """A Triton model's name: letters, digits, ``_.-``, 1 to 255 characters, not ``.`` or ``..``
    (it is a folder of the repository: ``../x`` or ``/x`` would be written elsewhere)."""
    if value is not None and (not TRITON_MODEL_NAME.fullmatch(value) or value in (".", "..")):
        shown = repr(value) if len(value) <= 64 else "this value"
        raise ValueError(f"{shown} is not a Triton model name (letters, digits, _ . -, 1 to 255 characters)")
    return value


def read_regular_file(path: Path, limit: int, what: str) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes, named ``what`` in the errors:
    a FIFO, a device or a directory is refused without blocking (a FIFO's open does not wait)."""
    data = read_regular_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: {path} is not UTF-8 (byte {exc.start})") from None


def read_regular_bytes(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, named ``what`` in the errors: a FIFO,
    a device or a directory is refused without blocking, a larger file without reading it."""
    try:
        fd, info = open_regular(path)
    except NotRegularFile:
        raise ValueError(f"{what}: {path} is not a regular file") from None
    except OSError as exc:
        raise ValueError(f"{what}: {exc.strerror}: {path}") from None
    try:
        if info.st_size > limit:
            raise ValueError(f"{what}: {path} is over {limit} bytes")
        data = read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{what}: {path} is over {limit} bytes")
    return data


class NotRegularFile(ValueError):
    """A FIFO, a device, a directory or a socket where a file was named."""


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``, if it is a regular file: opened without
    blocking (a FIFO's open does not wait) and checked on the descriptor, so what was checked is
    what is read. ``OSError`` if it cannot be opened, ``NotRegularFile`` if it is not a file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``fd`` (fewer at its end), read in chunks of at most 16 MiB."""
    chunks = []
    while limit > 0 and (chunk := os.read(fd, min(limit, 1 << 24))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def redact(url: str) -> str:
    """A URL (or ``user:password@host``) without its password, for logs, errors and listings."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if scheme else f"{user}:***@{host}"


def host_port(value: str) -> str:
    """``host:port``: a host name, an IPv4 address or a bracketed IPv6 one, and a port from 1 to
    65535, nothing else (no scheme, path or space). A port over 65535 was taken modulo 65536 by the
    gRPC client (99999 reached 34463), and a broken address passed for an unreachable server."""
    problem = f"{redact(value)!r} is not host:port (a host and a port from 1 to 65535, no scheme or path)"
    try:
        parts = urlsplit("//" + value)
        port = parts.port
    except ValueError:
        raise ValueError(problem) from None
    if (
        not parts.hostname
        or port is None
        or port < 1
        or parts.path
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
        or any(c.isspace() or ord(c) < 32 for c in value)
    ):
        raise ValueError(problem)
    return value
