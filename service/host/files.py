"""Files that appear whole or not at all, with the permissions any other file would get.

``tempfile.mkstemp`` creates its file 0600 so that nobody else can read it while it is written; a
file renamed into place keeps that mode. Models, checkpoints and Triton configs are read by other
users (the runtime image's user reads models that the build wrote as root; Triton reads a config
that ``gateway tune`` rewrote), so the file is given the mode a plain ``open`` would give it
(0666 less the umask) before it is renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_UMASK = os.umask(0o022)  # read once, at import (the process's umask, restored at once)
os.umask(_UMASK)


@contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write ``path`` through a temporary file in its folder, renamed over it when the block ends
    without an exception; on an exception the temporary file is removed and ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode) as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
