from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from loadtests.harness import network

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def can_make_namespaces() -> None:
    reason = network.check()
    if reason is not None:  # the benchmark skips the distributed architecture the same way
        pytest.skip(reason)


def _serve(ns: network.LinkedNamespace, folder: Path, port: int) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [*ns.launcher, sys.executable, "-m", "http.server", str(port), "--bind", ns.peer_address],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://{ns.peer_address}:{port}/", timeout=1).read()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise AssertionError("server in the namespace did not answer")


@pytest.mark.usefixtures("can_make_namespaces")
def test_a_server_in_the_namespace_is_reached_through_the_shaped_link(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "blob").write_bytes(payload)
    with network.LinkedNamespace(network.Shaping(rate="4mbit", delay_ms=1, jitter_ms=0)) as ns:
        name = ns.name
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "rate 4mbit" in ns.applied
        server = _serve(ns, tmp_path, 8123)
        try:
            start = time.monotonic()
            body = urllib.request.urlopen(f"http://{ns.peer_address}:8123/blob", timeout=30).read()
            seconds = time.monotonic() - start
        finally:
            server.kill()
            server.wait()
    assert body == payload
    # 8 Mbit at 4 Mbit/s cannot take less than 2 s: the rate limit is in force (a lower bound only)
    assert seconds > 1.5
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shaping_rejects_a_rate_it_cannot_read() -> None:
    assert network.Shaping(rate="5gbit").bits_per_second == 5_000_000_000
    assert network.Shaping(rate="2.5mbit").bits_per_second == 2_500_000
    with pytest.raises(ValueError, match="expected a number"):
        _ = network.Shaping(rate="fast").bits_per_second
