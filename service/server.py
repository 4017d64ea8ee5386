"""The serving process's composition root: the HTTP app (``service.http.app``) with the gRPC front
beside it (``service.grpc``) where ``GATEWAY_GRPC_PORT`` is not 0. ``gateway serve`` builds it; so
does each uvicorn worker process, through ``app_from_environment``."""

from __future__ import annotations

from fastapi import FastAPI

from service.grpc.server import grpc_front
from service.http.app import create_app
from service.settings import Settings


def create_server(settings: Settings) -> FastAPI:
    """The gateway as ``gateway serve`` runs it: HTTP, and gRPC on its own port unless it is off."""
    return create_app(settings, fronts=[grpc_front(settings)] if settings.grpc_port else [])


def app_from_environment() -> FastAPI:
    """uvicorn factory for several worker processes: each reads its settings from GATEWAY_*."""
    return create_server(Settings(**{}))  # every value from GATEWAY_* variables
