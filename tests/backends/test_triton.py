"""The gateway in front of a real Triton: labels, transports, shared memory, and Triton's failures."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from service.backends.embedded import EmbeddedBackend
from service.backends.triton import TritonBackend
from service.errors import BackendUnavailable
from service.images.preprocess import PreprocessConfig, prepare
from service.models.profiles import get_profile
from service.models.store import model_path
from service.settings import Settings
from service.triton.model_config import ReloadRefused, TritonModel
from service.triton.server import LocalTriton, TritonInstall
from tests.conftest import CAT_CLASSES, ESPRESSO, running_gateway
from tests.triton_server import SLOW_SECONDS, start_triton

pytestmark = pytest.mark.triton

MakeSettings = Callable[..., Settings]
TRANSPORTS = [("grpc", False), ("http", False), ("grpc", True), ("http", True)]
IDS = ["grpc", "http", "grpc-shm", "http-shm"]


def triton_settings(make: MakeSettings, server: LocalTriton, protocol: str, shm: bool, **kw: object) -> Settings:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    return make(backend="triton", triton_url=url, triton_protocol=protocol, triton_shared_memory=shm, **kw)


@pytest.mark.parametrize(("protocol", "shm"), TRANSPORTS, ids=IDS)
async def test_real_photos_through_triton(
    gateway_factory: MakeSettings, triton: LocalTriton, cat_jpeg: bytes, coffee_jpeg: bytes, protocol: str, shm: bool
) -> None:
    """GATEWAY_BACKEND=triton gives the same labels as the embedded backend, over gRPC and HTTP."""
    settings = triton_settings(gateway_factory, triton, protocol, shm)
    async with running_gateway(settings) as client:
        assert (await client.get("/readyz")).json()["ready"] is True
        files = [("file", ("cat.jpg", cat_jpeg, "image/jpeg")), ("file", ("coffee.jpg", coffee_jpeg, "image/jpeg"))]
        response = await client.post("/classify", files=files)
        assert response.status_code == 200, response.text
        cat, coffee = response.json()["results"]
        assert cat["labels"][0]["index"] in CAT_CLASSES
        assert coffee["labels"][0]["index"] == ESPRESSO


async def test_scores_match_embedded_and_shared_memory(
    models_dir: Path, triton: LocalTriton, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """Embedded, Triton over the socket and Triton through shared memory give the same scores, for
    a batch handed over as the batcher does (a list of images, laid out by each backend) and as one
    stacked array."""
    images = [prepare(cat_jpeg, PreprocessConfig()), prepare(coffee_jpeg, PreprocessConfig())] * 3
    batch = np.stack(images)
    embedded = EmbeddedBackend(model_path(models_dir, get_profile("efficientnet-lite0")))
    await embedded.start()
    reference = await embedded.infer(batch)
    assert np.array_equal(await embedded.infer(images), reference)
    await embedded.aclose()
    results = {}
    for protocol, shm in TRANSPORTS:
        url = triton.grpc_url if protocol == "grpc" else triton.http_url
        backend = TritonBackend(url=url, model="efficientnet-lite0", protocol=protocol, shared_memory=shm)  # type: ignore[arg-type]
        await backend.start()
        for _ in range(3):  # regions and buffers are reused across batches
            results[(protocol, shm)] = await backend.infer(images, timeout=30)
        assert np.array_equal(await backend.infer(batch, timeout=30), results[(protocol, shm)])
        await backend.aclose()
    assert np.array_equal(results[("grpc", False)], results[("grpc", True)])
    assert np.array_equal(results[("http", False)], results[("http", True)])
    for scores in results.values():
        np.testing.assert_allclose(scores, reference, atol=1e-5)


async def test_triton_queue_full_is_429(gateway_factory: MakeSettings, triton: LocalTriton) -> None:
    """Triton's "exceeds maximum queue size" reaches the client as 429 with Retry-After."""
    settings = triton_settings(
        gateway_factory, triton, "grpc", False, triton_model="slow", max_batch_size=1, max_inflight_batches=8
    )
    png = _png()
    async with running_gateway(settings) as client:
        responses = await asyncio.gather(
            *(client.post("/classify", content=png, headers={"content-type": "image/png"}) for _ in range(6))
        )
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected, statuses
    assert rejected[0].json()["error"] == "queue_full"
    assert "Triton's queue" in rejected[0].json()["detail"]
    assert rejected[0].headers["retry-after"] == "1"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_deadline_while_triton_works_is_504(
    gateway_factory: MakeSettings, triton: LocalTriton, protocol: str
) -> None:
    settings = triton_settings(
        gateway_factory, triton, protocol, False, triton_model="slow", max_batch_size=1, request_timeout=0.3
    )
    async with running_gateway(settings) as client:
        started = time.monotonic()
        response = await client.post("/classify", content=_png(), headers={"content-type": "image/png"})
        elapsed = time.monotonic() - started
    assert response.status_code == 504
    assert response.json()["error"] == "deadline_exceeded"
    assert elapsed < SLOW_SECONDS  # the gateway gave up at the deadline, not when Triton finished


async def test_model_with_the_wrong_shape_is_not_ready(
    gateway_factory: MakeSettings, triton: LocalTriton, caplog: pytest.LogCaptureFixture
) -> None:
    settings = triton_settings(gateway_factory, triton, "grpc", False, triton_model="wrong-shape")
    async with running_gateway(settings) as client:
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert "[-1, 100, 100, 3]" in readyz.json()["checks"]["backend"]
        response = await client.post("/classify", content=_png(), headers={"content-type": "image/png"})
        assert response.status_code == 500
        # Triton's own words may name its regions or paths: the log has them, the client a summary
        assert response.json()["detail"] == "Triton failed on the batch"
        assert any("unexpected shape" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_batches_larger_than_the_model_takes_are_not_ready(
    gateway_factory: MakeSettings, triton: LocalTriton, protocol: str
) -> None:
    """The test repository's model takes batches of up to 32: a gateway batching 64 is not ready and
    says why (before, it was ready and every full batch failed); batching 32 is ready."""
    settings = triton_settings(gateway_factory, triton, protocol, False, max_batch_size=64)
    async with running_gateway(settings) as client:
        readyz = await client.get("/readyz")
        assert readyz.status_code == 503
        assert (
            "max_batch_size 64 exceeds model efficientnet-lite0's max_batch_size 32"
            in readyz.json()["checks"]["backend"]
        )
    async with running_gateway(triton_settings(gateway_factory, triton, protocol, False, max_batch_size=32)) as client:
        assert (await client.get("/readyz")).status_code == 200


@pytest.mark.parametrize(("protocol", "shm"), TRANSPORTS, ids=IDS)
async def test_triton_killed_then_restarted(
    gateway_factory: MakeSettings,
    triton_install: TritonInstall,
    triton_repository: Path,
    tmp_path: Path,
    cat_jpeg: bytes,
    protocol: str,
    shm: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Triton dies mid-run: requests get 503 and /readyz says so; when it is back on the same ports,
    the gateway serves again without a restart (shared-memory regions are registered anew)."""
    server = start_triton(triton_install, triton_repository, tmp_path)
    try:
        settings = triton_settings(gateway_factory, server, protocol, shm, readiness_interval=0.2)
        async with running_gateway(settings) as client:

            async def classify() -> int:
                r = await client.post("/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
                if r.status_code == 200:
                    assert r.json()["results"][0]["labels"][0]["index"] in CAT_CLASSES
                else:
                    assert r.json()["error"] == "backend_unavailable", r.text
                return r.status_code

            assert await classify() == 200
            server.kill()
            assert await classify() == 503
            async with asyncio.timeout(5):  # /readyz reads the background check, every 0.2 s here
                while (readyz := await client.get("/readyz")).status_code != 503:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert "unreachable" in readyz.json()["checks"]["backend"]

            server.start(timeout=90)
            async with asyncio.timeout(30):  # the client reconnects on its own schedule
                while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
            assert [await classify() for _ in range(3)] == [200, 200, 200]
    finally:
        server.stop()
    if shm:  # the restarted Triton did not know the surviving region pair: it was registered again
        assert "shared-memory regions were lost" in caplog.text


async def test_readiness_recovers_after_an_outage_without_traffic(
    gateway_factory: MakeSettings,
    triton_install: TritonInstall,
    triton_repository: Path,
    tmp_path: Path,
    cat_jpeg: bytes,
) -> None:
    """Triton dies long enough for the circuit breaker to open; when it is back, polling /readyz
    alone (as a kubelet does: a pod out of rotation gets no requests) makes the pod ready again,
    and requests then pass. Before, /readyz stayed 503 until a /classify arrived."""
    server = start_triton(triton_install, triton_repository, tmp_path)
    settings = triton_settings(
        gateway_factory, server, "grpc", False, breaker_threshold=2, breaker_cooldown=1.0, readiness_interval=0.2
    )
    try:
        async with running_gateway(settings) as client:

            async def classify() -> int:
                r = await client.post("/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
                return r.status_code

            assert await classify() == 200
            server.kill()
            assert [await classify() for _ in range(3)] == [503, 503, 503]  # the third: refused by the open circuit
            await asyncio.sleep(1.5)  # longer than the cooldown
            assert (await client.get("/readyz")).status_code == 503
            server.start(timeout=90)
            async with asyncio.timeout(30):
                while (readyz := await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
            assert readyz.json()["checks"]["backend"] == "triton: ok"
            assert await classify() == 200
    finally:
        server.stop()


async def test_unreachable_triton_maps_to_backend_unavailable() -> None:
    backend = TritonBackend(url="127.0.0.1:9", model="efficientnet-lite0", protocol="http")
    await backend.start()
    with pytest.raises(BackendUnavailable, match="unreachable"):
        await backend.infer(np.zeros((1, 224, 224, 3), np.uint8), timeout=5)
    assert "unreachable" in (await backend.ready() or "")
    await backend.aclose()


def _png() -> bytes:
    from tests.conftest import png_bytes, solid_image

    return png_bytes(solid_image(1, 32))


def test_a_triton_without_explicit_model_control_is_refused_with_the_fix(
    triton: LocalTriton, triton_repository: Path
) -> None:
    model = TritonModel(triton_repository, "efficientnet-lite0", triton.grpc_url)
    with pytest.raises(ReloadRefused, match="--model-control-mode=explicit"):
        model.check_tunable(delay=True)
