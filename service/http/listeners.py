"""The HTTP server's listening sockets, made before anything else starts.

uvicorn binds its port only after the application's start-up (the models' load) has finished, so a
port in use was found after a model had loaded and the gateway had logged that it was ready. Here the
port is bound and listening first, as gunicorn's arbiter does, and the sockets are handed to uvicorn
(``Server.run(sockets=...)``, or ``Multiprocess`` for several workers, which share them). Connections
made while the models load wait in the kernel's backlog and are answered once the gateway is ready.

One socket per address the host resolves to (``localhost``: 127.0.0.1 and ::1), as asyncio's
``create_server`` makes them; with port 0 every one takes the port the first was given. ``::``
alone listens on IPv4 too, where the system allows (its default).
"""

from __future__ import annotations

import contextlib
import socket

BACKLOG = 2048
"""Connections the kernel holds for the server before it accepts them (uvicorn's default)."""


class ListenError(OSError):
    """The host and port cannot be listened on: the message says which, and why."""


def listen(host: str, port: int, backlog: int = BACKLOG) -> list[socket.socket]:
    """Sockets bound to ``host``:``port`` and listening, inheritable by worker processes."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    except UnicodeError:  # the name cannot be put in IDNA form (a label empty or over 63 characters)
        raise ListenError(f"cannot listen on {host}:{port}: not a valid host name") from None
    found = list(dict.fromkeys(found))
    both = {socket.AF_INET, socket.AF_INET6} <= {family for family, *_ in found}
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in found:
            if port == 0 and sockets:  # the port the first address was given, on every other
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and both:  # ::1 beside 127.0.0.1; "::" alone takes IPv4 too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(backlog)  # a second server that bound too is refused here, not after its start
            except OSError as exc:
                raise ListenError(f"cannot listen on {_shown(family, address)}: {exc.strerror}") from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        raise
    return sockets


def probe(host: str, port: int) -> None:
    """``ListenError`` unless ``host``:``port`` can be listened on now (a server that binds it later
    itself, such as the gRPC one, is told of a port in use before the models load)."""
    for sock in listen(host, port, backlog=1):
        sock.close()


def addresses(sockets: list[socket.socket]) -> str:
    """Where ``sockets`` listen, as URLs (``http://127.0.0.1:8000``)."""
    return ", ".join(f"http://{_shown(sock.family, sock.getsockname())}" for sock in sockets)


def _shown(family: int, address: tuple[object, ...]) -> str:
    host, port = address[0], address[1]
    return f"[{host!s}]:{port}" if family == socket.AF_INET6 else f"{host!s}:{port}"
