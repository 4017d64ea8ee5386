"""An online request whose client disconnects while it waits is cancelled: its image leaves the
batcher's queue before its batch is sent, and the backend never sees it (real uvicorn, real curl)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.backends.fake import FakeBackend
from service.models.profiles import ModelProfile
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.http.test_output_kinds import catalog_of, embedder_graph

MakeSettings = Callable[..., Settings]


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def metrics_when(client: httpx.AsyncClient, holds: Callable[[str], bool]) -> str:
    """The gateway's metrics once ``holds`` is true of them (10 s at most)."""
    async with asyncio.timeout(10):
        while not holds(metrics := (await client.get("/metrics")).text):  # noqa: ASYNC110 (polling the metrics is the point)
            await asyncio.sleep(0.02)
    return metrics


async def test_a_client_that_leaves_mid_wait_takes_its_image_out_of_the_queue(
    gateway_factory: MakeSettings, tmp_path: Path
) -> None:
    """One image per batch, one batch at a time. A's batch is held in the backend; B and then C
    wait in the queue; C's client (curl, giving up after 1 s) disconnects. C is counted as gone
    while A's batch is still held, and when the backend is let go it gets A and B only."""
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    settings = gateway_factory(backend="fake", max_batch_size=1, max_inflight_batches=1, max_delay=0.0)
    image = tmp_path / "c.png"
    image.write_bytes(png_bytes(solid_image(9, 32)))
    async with running_gateway(settings, backend) as client:
        post = {"headers": {"content-type": "image/png"}}
        first = asyncio.create_task(client.post("/classify", content=png_bytes(solid_image(7, 32)), **post))
        await backend.wait_for_batches(1)  # A is in the backend, held
        second = asyncio.create_task(client.post("/classify", content=png_bytes(solid_image(8, 32)), **post))
        gateway = client.app.state.gateway
        async with asyncio.timeout(10):
            while gateway.models.default.versions["1"].classifier.batcher.queue_depth < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        curl = await asyncio.create_subprocess_exec(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "1",
            "-H", "content-type: image/png", "--data-binary", f"@{image}", f"{client.base_url}/classify",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await curl.communicate()
        assert curl.returncode == 28, out  # curl's "operation timed out": it left without an answer
        await metrics_when(client, lambda text: counter(text, "gateway_client_disconnects_total") >= 1)
        assert gateway.models.default.versions["1"].classifier.batcher.queue_depth == 1  # B still waits; C has left
        assert backend.batches == [1]  # A's batch is still held
        backend.gate.set()
        answers = [await first, await second]
        metrics = (await client.get("/metrics")).text
    assert [a.json()["results"][0]["labels"][0]["index"] for a in answers] == [7, 8]
    assert backend.batches == [1, 1]  # A and B; C never reached the backend
    assert counter(metrics, "gateway_client_disconnects_total") == 1
    assert counter(metrics, "gateway_abandoned_images_total") == 1
    assert 'route="/classify",status="499"} 1.0' in metrics  # not counted as a failure of ours
    assert 'route="/classify",status="500"' not in metrics


async def test_a_client_that_stays_is_answered_and_nothing_is_counted(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend(delay=0.05)) as client:
        responses = await asyncio.gather(
            *(
                client.post("/classify", content=png_bytes(solid_image(v, 32)), headers={"content-type": "image/png"})
                for v in range(8)
            )
        )
        metrics = (await client.get("/metrics")).text
    assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in responses)
    assert counter(metrics, "gateway_client_disconnects_total") == 0
    assert counter(metrics, "gateway_abandoned_images_total") == 0


V2_INFER = "/v2/models/efficientnet-lite0/infer"
V2_ROUTE = 'route="/v2/models/{name}/infer"'


def _v2_body(image: bytes) -> tuple[bytes, str]:
    """A binary-data inference request (as tritonclient sends one) and its header's length."""
    element = struct.pack("<I", len(image)) + image
    tensor = {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(element)}}
    head = json.dumps({"inputs": [tensor]}).encode()
    return head + element, str(len(head))


async def test_an_inference_protocol_client_that_leaves_mid_wait_is_dropped_and_counted_499(
    gateway_factory: MakeSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``/v2/.../infer`` has ``/classify``'s disconnect handling: A's batch is held in the backend, a
    v2 client (curl, giving up after 1 s) waits in the queue and leaves; its image leaves the queue,
    the backend never sees it, and it is counted 499 (it was computed and counted 200)."""
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    settings = gateway_factory(backend="fake", max_batch_size=1, max_inflight_batches=1, max_delay=0.0)
    body, header_length = _v2_body(png_bytes(solid_image(9, 32)))
    request = tmp_path / "infer.bin"
    request.write_bytes(body)
    async with running_gateway(settings, backend) as client:
        first = asyncio.create_task(
            client.post("/classify", content=png_bytes(solid_image(7, 32)), headers={"content-type": "image/png"})
        )
        await backend.wait_for_batches(1)  # A is in the backend, held
        curl = await asyncio.create_subprocess_exec(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "1",
            "-H", f"Inference-Header-Content-Length: {header_length}",
            "-H", "content-type: application/octet-stream",
            "--data-binary", f"@{request}", f"{client.base_url}{V2_INFER}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await curl.communicate()
        assert curl.returncode == 28, out  # curl's "operation timed out": it left without an answer
        await metrics_when(client, lambda text: counter(text, "gateway_client_disconnects_total") >= 1)
        batcher = client.app.state.gateway.models.default.versions["1"].classifier.batcher
        assert batcher.queue_depth == 0  # the v2 request's image has left the queue
        backend.gate.set()
        assert (await first).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert backend.batches == [1]  # the v2 image never reached the backend
    assert counter(metrics, "gateway_abandoned_images_total") == 1
    assert f'{V2_ROUTE},status="499"}} 1.0' in metrics
    assert f'{V2_ROUTE},status="200"' not in metrics
    # never answered: counted, not timed (its wait would read as a slow 4xx answer)
    assert f'gateway_http_request_duration_seconds_count{{{V2_ROUTE},status="499"}}' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", ["/classify", V2_INFER])
async def test_a_client_that_leaves_mid_body_is_counted_499_not_500(
    gateway_factory: MakeSettings, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends half its declared body and closes: no traceback, counted 499 (on
    ``/v2`` it was a 500 with a ``ClientDisconnect`` traceback); the next client is served."""
    body, header_length = _v2_body(png_bytes(solid_image(9, 32)))
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        port = client.base_url.port
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {header_length}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        await writer.drain()
        await asyncio.sleep(0.2)  # the request is being read
        writer.close()
        await writer.wait_closed()
        route = path if path == "/classify" else "/v2/models/{name}/infer"
        metrics = await metrics_when(client, lambda text: f'route="{route}",status="499"' in text)
        served = await client.post(
            V2_INFER,
            content=body,
            headers={"Inference-Header-Content-Length": header_length, "content-type": "application/octet-stream"},
        )
    assert served.status_code == 200
    assert f'route="{route}",status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_inference_protocol_body_too_slow_is_counted_408(
    gateway_factory: MakeSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``/v2`` body that stops arriving gets the protocol's 408 within the body timeout, and the
    request is counted 408 (it was a 500 with a ``ClientDisconnect`` traceback)."""
    body, header_length = _v2_body(png_bytes(solid_image(9, 32)))
    async with running_gateway(gateway_factory(backend="fake", body_timeout=0.5), FakeBackend()) as client:
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(
            f"POST {V2_INFER} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {header_length}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()
        writer.close()
        metrics = await metrics_when(client, lambda text: f'{V2_ROUTE},status="408"' in text)
    assert answer.startswith(b"HTTP/1.1 408")
    assert f'{V2_ROUTE},status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _noise_png(side: int) -> bytes:
    """A PNG that does not compress (about 3 bytes a pixel): a photo's size, not a test pattern's."""
    rng = np.random.default_rng(side)
    return png_bytes(rng.integers(0, 256, (side, side, 3), np.uint8))


@pytest.mark.parametrize("path", ["/classify", V2_INFER])
async def test_a_client_that_leaves_after_a_photos_body_is_seen(gateway_factory: MakeSettings, path: str) -> None:
    """A body over uvicorn's 64 KiB high-water mark (a 300 KB photo), sent whole, then the client
    closes while its image waits in the queue: its leaving is seen, the image leaves the queue and
    the request is counted 499. Reading stayed paused once the body was complete (the high-water
    mark's pause is lifted by the app's next receive(), which never came): the close went unread,
    and the image was computed and counted 200 for nobody (5 of 5 such requests on a real gateway)."""
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    settings = gateway_factory(backend="fake", max_batch_size=1, max_inflight_batches=1, max_delay=0.0)
    photo = _noise_png(320)
    assert len(photo) > 256 * 1024
    body, header_length = _v2_body(photo) if path == V2_INFER else (photo, "")
    extra = f"Inference-Header-Content-Length: {header_length}\r\n" if header_length else ""
    async with running_gateway(settings, backend) as client:
        held = asyncio.create_task(
            client.post("/classify", content=png_bytes(solid_image(7, 32)), headers={"content-type": "image/png"})
        )
        await backend.wait_for_batches(1)  # A is in the backend, held
        batcher = client.app.state.gateway.models.default.versions["1"].classifier.batcher
        _reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        async with asyncio.timeout(10):
            while batcher.queue_depth < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        writer.close()
        await writer.wait_closed()
        await metrics_when(client, lambda text: counter(text, "gateway_client_disconnects_total") >= 1)
        assert batcher.queue_depth == 0  # its image has left the queue
        backend.gate.set()
        assert (await held).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert backend.batches == [1]  # the photo never reached the backend
    route = 'route="/classify"' if path == "/classify" else V2_ROUTE
    assert f'{route},status="499"}} 1.0' in metrics


EMBED = "/v1/models/emb/embed"
EMBED_ROUTE = 'route="/v1/models/{name}/embed"'


@pytest.mark.parametrize("path", [EMBED, "/v1/models/emb/versions/1/embed"])
async def test_an_embed_client_that_leaves_mid_wait_is_dropped_and_counted_499(
    gateway_factory: MakeSettings, tmp_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``/v1/models/{name}[/versions/{v}]/embed`` has ``/classify``'s disconnect handling: A's batch
    (an embedding model's) is held in the backend, an /embed client (curl, giving up after 1 s) waits
    in the queue and leaves; its image leaves the queue, the backend never sees it, and it is counted
    499 under its route (through FastAPI's routing it stayed queued, was computed and counted 200)."""
    backend = FakeBackend(classes=16)
    backend.gate = asyncio.Event()
    settings = gateway_factory(backend="fake", max_batch_size=1, max_inflight_batches=1, max_delay=0.0)
    profile = ModelProfile(
        "fake-embedder", "1", (32, 32), 0.875, 1, lambda weights: embedder_graph(), output="embedding",
        dimensions=16,
    )  # fmt: skip
    image = tmp_path / "c.png"
    image.write_bytes(png_bytes(solid_image(9, 32)))
    route = EMBED_ROUTE if path == EMBED else 'route="/v1/models/{name}/versions/{version}/embed"'
    async with running_gateway(settings, backend, catalog_of(settings, ("emb", profile))) as client:
        first = asyncio.create_task(
            client.post(EMBED, content=png_bytes(solid_image(7, 32)), headers={"content-type": "image/png"})
        )
        await backend.wait_for_batches(1)  # A is in the backend, held
        batcher = client.app.state.gateway.models.default.versions["1"].classifier.batcher
        curl = await asyncio.create_subprocess_exec(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "1",
            "-H", "content-type: image/png", "--data-binary", f"@{image}", f"{client.base_url}{path}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await curl.communicate()
        assert curl.returncode == 28, out  # curl's "operation timed out": it left without an answer
        await metrics_when(client, lambda text: counter(text, "gateway_client_disconnects_total") >= 1)
        assert batcher.queue_depth == 0  # the /embed request's image has left the queue
        backend.gate.set()
        held = await first
        metrics = (await client.get("/metrics")).text
    assert held.status_code == 200, held.text
    assert held.json()["embeddings"][0]["vector"] == [1.0 if i == 7 else 0.0 for i in range(16)]
    assert backend.batches == [1]  # the image of the client that left never reached the backend
    assert counter(metrics, "gateway_abandoned_images_total") == 1
    assert f'{route},status="499"}} 1.0' in metrics
    assert f'{route},status="500"' not in metrics
    if path != EMBED:
        assert f'{route},status="200"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
