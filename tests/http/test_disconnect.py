"""An online request whose client disconnects while it waits is cancelled: its image leaves the
batcher's queue before its batch is sent, and the backend never sees it (real uvicorn, real curl)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import httpx

from service.backends.fake import FakeBackend
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


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
        async with asyncio.timeout(10):
            while counter((await client.get("/metrics")).text, "gateway_client_disconnects_total") < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
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
