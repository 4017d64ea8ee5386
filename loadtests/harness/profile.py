"""Where a process's CPU goes during a run: ``py-spy record`` (sampling, without pausing the
process) into a collapsed-stack file, and its heaviest functions, self and inclusive.

py-spy is optional: without it on the PATH or beside the installed packages (``pip --target``
puts it in ``<target>/bin``), nothing is recorded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    for folder in [Path(sys.executable).parent, *(Path(entry or ".") / "bin" for entry in sys.path)]:
        candidate = folder / "py-spy"
        if candidate.is_file():
            return str(candidate)
    return None


def record(pid: int, seconds: float, out: Path, rate: int = 200, delay: float = 0.0) -> subprocess.Popen[bytes] | None:
    """Start sampling ``pid`` (its threads, native frames left out) for ``seconds``, ``delay``
    seconds from now, into ``out`` (collapsed stacks); None when py-spy is not installed."""
    binary = py_spy()
    if binary is None:
        return None
    command = [binary, "record", "--pid", str(pid), "--duration", f"{max(1, round(seconds))}", "--rate", str(rate)]
    command += ["--format", "raw", "--nonblocking", "--output", str(out)]
    if delay > 0:
        command = ["sh", "-c", f'sleep {delay:g}; exec "$0" "$@"', *command]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def heaviest(collapsed: Path, count: int = 15) -> tuple[int, list[tuple[str, float, float]]]:
    """The samples, and the ``count`` functions with the most, as (function, self %, inclusive %),
    by self time first."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        samples = int(number)
        total += samples
        frames = [_function(frame) for frame in stack.split(";")]
        own[frames[-1]] += samples
        for frame in set(frames):
            within[frame] += samples
    if not total:
        return 0, []
    ranked = [(name, 100 * n / total, 100 * within[name] / total) for name, n in own.most_common(count)]
    return total, ranked


def _function(frame: str) -> str:
    """``name (path/file.py:line)`` without the line (and the thread prefix py-spy may add)."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({Path(where).name})" if where else name
