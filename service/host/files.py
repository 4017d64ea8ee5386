"""Files and folders that appear whole or not at all, with the permissions any other would get.

``tempfile.mkstemp`` and ``mkdtemp`` create 0600 files and 0700 folders, and a rename keeps that
mode. Models, checkpoints and Triton configs are read by other users (the runtime image's user
reads models that its build wrote as root; Triton reads a config that ``gateway tune`` rewrote), so
the temporary file or folder is created as ``open`` and ``mkdir`` create theirs: 0666 or 0777 less
the process's umask, which the kernel applies."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_ATTEMPTS = 100


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}")


def _create_file(path: Path) -> tuple[int, Path]:
    for _ in range(_ATTEMPTS):
        tmp = _temporary_name(path)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file in its folder, renamed over it when the block ends
    without an exception; on an exception the temporary file is removed and ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_file(path)
    try:
        out = os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        with out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A temporary folder beside ``path``, filled in the block, then put in its place (what was at
    ``path`` is removed first); on an exception it is removed and ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(_ATTEMPTS):
        tmp = _temporary_name(path)
        try:
            os.mkdir(tmp, 0o777)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        yield tmp
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
