from __future__ import annotations

import asyncio
import io
import os
import socket
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from skimage import data as skdata

from service.backends.base import Backend
from service.grpc.server import grpc_front
from service.http.app import create_app
from service.http.refusing import http_protocol
from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.serving.catalog import Catalog
from service.settings import Settings
from service.tune.runner import free_port
from tests.triton_server import triton, triton_install, triton_repository  # noqa: F401 (fixtures)

# tests/image checks a built image: scripts/image-test builds it and names it in GATEWAY_TEST_IMAGE.
collect_ignore = [] if os.environ.get("GATEWAY_TEST_IMAGE") else ["image"]
# Gateways the tests start (in this process and as `gateway serve`) leave gRPC off unless a test asks
# for it on a free port: several at once cannot all have the default one.
os.environ["GATEWAY_GRPC_PORT"] = "0"

FIRST = ("tests/jobs/test_cluster.py", "tests/tune/test_tune.py", "tests/tune/test_tune_triton.py")
"""The modules that take longest (minutes each), collected first: run in parallel (scripts/test),
they start while the many short ones fill the other processes, rather than ending the run alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "models_dir" in getattr(item, "fixturenames", ()):  # it serves or runs the built model
            item.add_marker(pytest.mark.model)
    rank = {module: i for i, module in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(FIRST)))  # stable: else as collected


CAT_CLASSES = {281, 282, 283, 284, 285, 286, 287}  # tabby, tiger cat, Persian, Siamese, Egyptian, cougar, lynx
ESPRESSO = 967


def encode(rgb: np.ndarray, ext: str = ".jpg") -> bytes:
    ok, buf = cv2.imencode(ext, np.ascontiguousarray(rgb[:, :, ::-1]) if rgb.ndim == 3 else rgb)
    assert ok
    return buf.tobytes()


@pytest.fixture(scope="session")
def cat_jpeg() -> bytes:
    """scikit-image's 'chelsea': a photo of a tabby cat."""
    return encode(skdata.chelsea())


@pytest.fixture(scope="session")
def coffee_jpeg() -> bytes:
    """scikit-image's 'coffee': a photo of a cup of espresso."""
    return encode(skdata.coffee())


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory with EfficientNet-Lite0 built once for the whole session."""
    path = tmp_path_factory.mktemp("models")
    ensure_model(path, get_profile("efficientnet-lite0"))
    return path


def solid_image(value: int, size: int = 224) -> np.ndarray:
    return np.full((size, size, 3), value, np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def crafted_png(width: int, height: int, colour_type: int = 2) -> bytes:
    """A well-formed 8-bit PNG whose header claims width x height, with one tiny IDAT."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@asynccontextmanager
async def running_prometheus(config: Path, data: Path, *flags: str) -> AsyncIterator[httpx.AsyncClient]:
    """A real Prometheus (Debian's package) with ``config`` (and more ``flags``); yields a client
    for its HTTP API once it is ready."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        *flags,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            async with asyncio.timeout(30):
                while True:
                    try:
                        if (await client.get("/-/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
            yield client
    finally:
        process.terminate()
        await process.wait()


def _bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    return sock


class GatewayClient(httpx.AsyncClient):
    """A client of a test gateway, with the app it talks to (``app.state.gateway``), for tests that
    wait on the gateway's own state instead of guessing a delay."""

    app: FastAPI
    grpc_url: str
    """host:port of its gRPC front (``running_gateway(..., grpc=True)``)."""


@asynccontextmanager
async def running_gateway(
    settings: Settings, backend: Backend | None = None, catalog: Catalog | None = None, *, grpc: bool = False
) -> AsyncIterator[GatewayClient]:
    """A real uvicorn server on a free loopback port, in this event loop; yields a client for it
    (``catalog``: its models, by default the settings'). With ``grpc``, the gRPC front too, on
    another free port (``client.grpc_url``).

    The socket is bound before the server starts, so requests wait in its backlog until the
    lifespan has finished: no polling for readiness."""
    sock = _bound_socket()
    port = sock.getsockname()[1]
    fronts = []
    if grpc:
        settings = settings.model_copy(update={"grpc_port": free_port()})
        fronts.append(grpc_front(settings))
    app = create_app(settings, backend=backend, catalog=catalog, fronts=fronts)
    protocol = http_protocol(settings.header_timeout, settings.body_timeout, settings.max_body_bytes)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", http=protocol, limit_concurrency=settings.max_connections
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with GatewayClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            client.app = app
            client.grpc_url = f"127.0.0.1:{settings.grpc_port}"
            if grpc:  # answered once the lifespan, which starts the gRPC front, is done
                await client.get("/healthz")
            yield client
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture
def gateway_factory(models_dir: Path) -> Callable[..., Settings]:
    """Settings for a test gateway: the session's models directory plus the given overrides."""

    def make(**overrides: object) -> Settings:
        return Settings(models_dir=models_dir, **overrides)  # type: ignore[arg-type]

    return make


async def readyz_becomes(client: httpx.AsyncClient, status: int, timeout: float = 5.0) -> httpx.Response:
    """Poll /readyz until it answers ``status`` (it reads the background check, not the backend)."""
    async with asyncio.timeout(timeout):
        while (response := await client.get("/readyz")).status_code != status:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return response
