"""The HTTP server's listening sockets (``service.http.listeners``): a host that cannot be listened
on is a clear error from ``gateway serve``, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.http.listeners import ListenError, listen


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "gateway..example"], ids=["label-over-63", "empty-label"])
def test_a_host_name_idna_refuses_is_a_listen_error(host: str) -> None:
    """A host name that cannot be put in IDNA form (a label over 63 characters, or empty) is a
    ``ListenError`` naming it: ``getaddrinfo`` raises ``UnicodeError`` there, not ``gaierror``."""
    with pytest.raises(ListenError, match=f"cannot listen on {host}:0: not a valid host name"):
        listen(host, 0)


def test_serve_on_a_host_name_idna_refuses_exits_naming_the_settings() -> None:
    """``gateway serve --host <a label of 64 characters>`` exits 1 at once with one line naming the
    address and the settings to change (it ended in a ``UnicodeError`` traceback)."""
    host = "a" * 64 + ".example"
    done = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--backend", "fake", "--host", host, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on {host}:0: not a valid host name" in done.stderr
    assert "--host / GATEWAY_HOST" in done.stderr
    assert "Traceback" not in done.stderr
