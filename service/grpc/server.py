"""The gRPC server of one gateway process: ``grpc.aio`` on the HTTP server's event loop, started
once the gateway's models are open and stopped first at shutdown (its calls in progress finish,
within the HTTP server's own grace).

Every worker process serves the port: with several workers each binds it with ``SO_REUSEPORT`` and
the kernel spreads new connections over them, as it spreads HTTP connections over the shared
socket; a single process binds it alone, so a second gateway on the same port fails to start
instead of silently sharing it. The limits come from the HTTP front's: a message is at most
``max_body_bytes``, a connection carries at most ``grpc_max_concurrent_streams`` calls at once, and
metadata (headers) at most ``MAX_METADATA_BYTES``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import grpc

from service.grpc.calls import Calls, KeyCheck
from service.grpc.methods import add_to_server
from service.grpc.servicer import InferenceServicer
from service.http.gateway import Gateway
from service.settings import Settings

logger = logging.getLogger(__name__)

MAX_METADATA_BYTES = 16 * 1024
"""Metadata (gRPC's headers) one call may send: an API key, a request id and a trace context
need far less; more is refused by the transport with RESOURCE_EXHAUSTED."""


class GrpcStartError(RuntimeError):
    """The gRPC port cannot be listened on."""


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


IDLE_CONNECTION_SECONDS = 300
"""A connection with no call for this long is closed (GOAWAY; a client's channel reconnects at its
next call): idle connections do not pile up."""


def server_options(settings: Settings) -> list[tuple[str, int]]:
    return [
        # connections and calls: at most as many as HTTP's connections and tasks (max_connections,
        # each costs a descriptor or a task); a client that never sends HTTP/2's preface is dropped
        # after header_timeout, an idle connection after 5 minutes
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.server_handshake_timeout_ms", int(settings.header_timeout * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_SECONDS * 1000),
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", max(settings.max_body_bytes, 64 * 1024 * 1024)),
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        # a client's calls beyond that wait for a stream, as HTTP/2 says; grpcio's default refuses them
        # (UNAVAILABLE "Stream removed": 49 of 64 calls on one connection limited to 4, measured)
        ("grpc.http.overload_protection", 0),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.so_reuseport", 1 if settings.workers > 1 else 0),
        # a client that pings without calls is dropped, not answered forever
        ("grpc.http2.max_ping_strikes", 2),
    ]


def grpc_front(settings: Settings) -> Callable[[Gateway], AbstractAsyncContextManager[None]]:
    """What the HTTP app's lifespan runs beside it (``create_app(..., fronts=...)``): the gRPC
    server over the gateway, from the gateway's start to its shutdown."""

    @asynccontextmanager
    async def running(gateway: Gateway) -> AsyncIterator[None]:
        calls = Calls(gateway, gateway.keys, gateway.tracing)
        server = grpc.aio.server(
            options=server_options(settings),
            maximum_concurrent_rpcs=settings.max_connections,
            interceptors=[KeyCheck(calls)] if calls.keys else [],
        )
        add_to_server(InferenceServicer(calls), calls, server)
        address = grpc_address(settings.host, settings.grpc_port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise GrpcStartError(f"cannot listen on {address} for gRPC (GATEWAY_GRPC_PORT): {exc}") from None
        if not bound:
            raise GrpcStartError(f"cannot listen on {address} for gRPC (GATEWAY_GRPC_PORT)")
        await server.start()
        logger.info("gRPC (Open Inference Protocol) on %s", address)
        try:
            yield
        finally:
            await server.stop(grace=settings.request_timeout + 1)

    return running
