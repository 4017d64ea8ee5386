"""Tests of the benchmark harness (``loadtests.harness``), and smoke tests that run each figure as a
user does: ``python -m loadtests.<figure>`` in a process of its own, asserting on what it prints.
No test imports a figure module (``tests/test_layout.py`` checks it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root, where ``python -m loadtests.<figure>`` is run from."""


def run_figure(figure: str, *args: str, timeout: float = 600) -> str:
    """``python -m loadtests.<figure> ARGS`` from the repository's root; what it printed on stdout.
    It must exit 0 (its stderr, the end of it, is the failure's message)."""
    done = subprocess.run(
        [sys.executable, "-m", f"loadtests.{figure}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"loadtests.{figure} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout
