"""The worker's Prometheus endpoint, a port per worker process, so that several workers on one host
(docs/routing.md starts two; a new one starts while the old one drains) each export their metrics.

A worker serves ``/metrics`` on the first free port of ``worker_metrics_port`` (9101) and the
``worker_metrics_ports - 1`` after it, and logs which it took. In a container or a Kubernetes pod
it is alone in its network namespace and always takes the first, the port the manifests name; on
a host the second worker takes 9102, and so on. Ports are tried by binding them, so two workers
starting at the same instant never take the same one; a port that cannot be bound for another
reason than being in use (a privileged port, an address not on this host) stops the worker with
that reason, as does a range all in use, naming the settings to change.
"""

from __future__ import annotations

import errno
import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from service.settings import Settings
from service.settings.values import setting_name

logger = logging.getLogger(__name__)


class MetricsEndpoint:
    """The running endpoint: the port it took, and how to stop it."""

    def __init__(self, server: WSGIServer, port: int) -> None:
        self.server = server
        self.port = port

    def close(self) -> None:
        """Stop serving and free the port (blocks until the server's thread has seen it: call it
        off the event loop)."""
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(settings: Settings, registry: CollectorRegistry) -> MetricsEndpoint | None:
    """Serve ``registry`` on the first free port of the worker's range (None when the port is 0)."""
    first = settings.worker_metrics_port
    if not first:
        return None
    last = min(65535, first + settings.worker_metrics_ports - 1)
    for port in range(first, last + 1):
        try:
            server, _ = start_http_server(port, addr=settings.host, registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            raise SystemExit(
                f"gateway worker: cannot serve metrics on {settings.host}:{port} ({exc.strerror or exc}); "
                f"see {setting_name('worker_metrics_port')} and {setting_name('host')}"
            ) from exc
        logger.info("worker: metrics on port %d (/metrics)", port)
        return MetricsEndpoint(server, port)
    raise SystemExit(
        f"gateway worker: every metrics port from {first} to {last} is in use (other workers on this host?); "
        f"allow more with {setting_name('worker_metrics_ports')}, or start from another port with "
        f"{setting_name('worker_metrics_port')} (0: no metrics)"
    )
