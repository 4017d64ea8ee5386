"""Images at the edges of geometry through a real gateway on every backend (fake, embedded ONNX
Runtime, OpenVINO, torch): each answers a label or a clear 400, never a 500 (the images are built
in ``tests.images.edge_images``; ``tests/jobs/test_edge_geometry.py`` sends them through a worker)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.images.preprocess import OPENCV_MAX_SIDE
from service.settings import Settings
from tests.conftest import running_gateway
from tests.images.edge_images import FORMATS, edge_image, geometries, header_sized, refused

MakeSettings = Callable[..., Settings]
IMAGES = [
    (f"{fmt}-{w}x{h}-o{orientation}", fmt, edge_image(fmt, w, h, orientation), refused(fmt, w, h))
    for fmt in FORMATS
    for w, h in geometries(fmt)
    for orientation in (1, 6)
]
"""(name, format, bytes, whether the gateway must refuse it) of every edge geometry, upright and
turned (orientation 6: rotate 90 degrees)."""
BACKENDS = {
    "fake": {"backend": "fake"},
    "embedded": {"backend": "embedded"},
    "openvino": {"backend": "openvino", "openvino_precision": "fp32"},
    "torch": {"backend": "torch", "model": "resnet50", "torch_device": "cpu"},
}


async def classify(client: httpx.AsyncClient, fmt: str, data: bytes, **params: str) -> httpx.Response:
    return await client.post("/classify", params=params, content=data, headers={"content-type": f"image/{fmt}"})


def is_clear_400(answer: httpx.Response, name: str) -> None:
    assert answer.status_code == 400, (name, answer.text)
    body = answer.json()
    assert body["error"] == "bad_image", (name, body)
    assert "pixels a side" in body["detail"], (name, body)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
async def test_edge_geometries_through_classify_on_every_backend(gateway_factory: MakeSettings, backend: str) -> None:
    """1x1, 1xN, Nx1, 1x65535 and the longest sides each decoder takes, upright and turned, to
    ``/classify`` on each backend: 200 with five labels, or (a side over the decoder's) 400
    ``bad_image`` saying so; never a 500, and the gateway serves on."""
    settings = gateway_factory(**BACKENDS[backend])
    async with running_gateway(settings, FakeBackend() if backend == "fake" else None) as client:
        for name, fmt, data, must_refuse in IMAGES:
            answer = await classify(client, fmt, data)
            if must_refuse:
                is_clear_400(answer, name)
            else:
                assert answer.status_code == 200, (name, answer.text)
                assert len(answer.json()["results"][0]["labels"]) == 5, name
        assert (await client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("fmt", ["bmp", "tiff"])
async def test_a_side_past_opencvs_through_classify_and_v2_is_a_clear_400(
    gateway_factory: MakeSettings, fmt: str
) -> None:
    """A BMP or TIFF whose header says 2^20 + 1 x 1 (small in memory: past OpenCV's side for any
    format): 400 ``bad_image`` naming the side on ``/classify`` and the Open Inference Protocol's
    infer route (OpenCV's assertion was a 500 and a traceback), and the gateway serves on."""
    data = header_sized(fmt, OPENCV_MAX_SIDE + 1, 1)
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        is_clear_400(await classify(client, fmt, data), fmt)
        header = {
            "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(data).decode()]}]
        }
        answer = await client.post("/v2/models/efficientnet-lite0/infer", content=json.dumps(header))
        assert answer.status_code == 400, answer.text
        assert f"at most {OPENCV_MAX_SIDE} pixels a side" in answer.json()["error"]
        assert (await client.get("/healthz")).status_code == 200
