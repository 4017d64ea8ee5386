"""`gateway alive`, the worker's liveness probe, run as compose and Kubernetes run it: a process
of its own, configured by the environment (docker-compose.yml, k8s/base/worker.yaml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import Settings


def alive(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``gateway alive --max-age 30`` with ``args`` in ``cwd``, with no ``GATEWAY_*`` variable but
    ``env`` and ``TMPDIR`` at ``cwd`` (where the default heartbeat file lives)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "service", "alive", "--max-age", "30", *args],
        cwd=cwd,
        env={**base, "TMPDIR": str(cwd), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_fresh_heartbeat_is_alive(tmp_path: Path) -> None:
    """The control: the default file ($TMPDIR/gateway-worker.heartbeat), just touched, passes quietly."""
    (tmp_path / "gateway-worker.heartbeat").touch()
    result = alive(tmp_path)
    assert (result.returncode, result.stderr) == (0, "")


def test_an_empty_heartbeat_setting_fails_and_says_what_is_missing(tmp_path: Path) -> None:
    """``GATEWAY_WORKER_HEARTBEAT_FILE=`` (what compose's ``${VAR:-}`` gives when unset) means no
    heartbeat file: the worker touches none, and the probe fails saying which setting or flag to
    give. (It was read as the current directory, whose recent change passed for a heartbeat: exit
    0, silently, whatever the worker did.)"""
    (tmp_path / "recent").touch()  # the directory changed a moment ago
    for blank in ("", "  "):
        result = alive(tmp_path, GATEWAY_WORKER_HEARTBEAT_FILE=blank)
        assert result.returncode != 0, result
        assert "no heartbeat file" in result.stderr
        assert "GATEWAY_WORKER_HEARTBEAT_FILE" in result.stderr
        assert "--file" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("given", ["", "."])
def test_a_directory_is_not_a_heartbeat(tmp_path: Path, given: str) -> None:
    """``--file ''`` (or a directory) fails saying the path is a directory: other processes change a
    directory's time, so it proves nothing about the worker's loop."""
    (tmp_path / "recent").touch()
    result = alive(tmp_path, "--file", given)
    assert result.returncode != 0, result
    assert "is a directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_heartbeat_file_says_it_does_not_exist(tmp_path: Path) -> None:
    """A file the worker never touched (not started, or another TMPDIR or setting) fails with a
    message that says so, not an age of "inf" seconds."""
    result = alive(tmp_path)
    assert result.returncode == 1
    assert f"{tmp_path / 'gateway-worker.heartbeat'} does not exist" in result.stderr
    assert "GATEWAY_WORKER_HEARTBEAT_FILE" in result.stderr
    assert "inf" not in result.stderr


def test_the_worker_writes_no_heartbeat_when_the_setting_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker reads the same setting: empty is none (not the current directory)."""
    monkeypatch.setenv("GATEWAY_WORKER_HEARTBEAT_FILE", "")
    assert Settings().worker_heartbeat_file is None  # type: ignore[call-arg]
