"""tritonclient's client modules, by protocol. gRPC's comes with the gateway (it is also the KServe
v2 gRPC protocol the gateway speaks); HTTP's needs gevent, which only the ``triton`` extra installs
(``pip install 'inference-gateway[triton]'``), so a missing one says so instead of an ImportError."""

from __future__ import annotations

import importlib
from types import ModuleType


def client_module(protocol: str, aio: bool = False) -> ModuleType:
    """``tritonclient.grpc`` or ``tritonclient.http`` (their ``.aio`` with ``aio``)."""
    name = f"tritonclient.{'grpc' if protocol == 'grpc' else 'http'}{'.aio' if aio else ''}"
    try:
        return importlib.import_module(name)
    except (ImportError, RuntimeError) as exc:  # tritonclient raises RuntimeError when gevent is missing
        raise RuntimeError(
            f"GATEWAY_TRITON_PROTOCOL={protocol} needs tritonclient's {protocol.upper()} client, not installed "
            f"here: pip install 'inference-gateway[triton]'"
        ) from exc
