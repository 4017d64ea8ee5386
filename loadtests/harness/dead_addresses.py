"""Broker addresses that do not answer, as a dead node's do, for the fail-over tests and figure.

- ``refused``: a port bound but not listening, so a connect is refused at once (a stopped broker,
  a host that answers with a reset);
- ``blackholed``: a port whose one-slot accept queue is already full, so Linux drops the SYN of any
  further connect and the client waits, as for a host gone from the network (no firewall rule, no
  root needed).

Each holds its socket(s) until the ``with`` block ends, so no other process takes the port meanwhile.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def url_of(port: int) -> str:
    return f"amqp://guest:guest@127.0.0.1:{port}/"


@contextmanager
def refused() -> Iterator[str]:
    """The URL of a loopback port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield url_of(sock.getsockname()[1])


@contextmanager
def blackholed() -> Iterator[str]:
    """The URL of a loopback port that drops every new connection's SYN."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # a queue of one connection, never accepted
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # takes that one place
            yield url_of(port)
