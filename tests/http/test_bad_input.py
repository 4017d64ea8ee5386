"""Every kind of bad or unusual input the issue lists, over HTTP against the real model: each gets
a clear answer, and a stream of good requests running alongside is never harmed."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import Any

import cv2
import httpx
import numpy as np
from PIL import Image
from skimage import data as skdata

from service.settings import Settings
from tests.conftest import CAT_CLASSES, crafted_png, running_gateway


def _pil(image: Image.Image, fmt: str, **kw: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kw)
    return buffer.getvalue()


def corpus() -> list[tuple[str, dict[str, Any], int, str | None]]:
    """(case, request kwargs, expected status, expected error code or None)."""
    cat = skdata.chelsea()
    cat_jpeg = _pil(Image.fromarray(cat), "JPEG")
    rotated = Image.fromarray(np.ascontiguousarray(np.rot90(cat)))  # stored on its side...
    exif = rotated.getexif()
    exif[0x0112] = 6  # ...and tagged "rotate 90 clockwise to display"
    sixteen = cv2.imencode(".png", (cat[:, :, ::-1].astype(np.uint16) * 257))[1].tobytes()
    raw = {"headers": {"content-type": "image/jpeg"}}
    many = [("file", (f"{i}.png", _pil(Image.new("RGB", (2, 2)), "PNG"), "image/png")) for i in range(1000)]
    return [
        ("empty body", {"content": b"", **raw}, 400, "bad_image"),
        ("truncated jpeg", {"content": cat_jpeg[: len(cat_jpeg) // 2], **raw}, 400, "bad_image"),
        ("text named .jpg", {"files": {"file": ("notes.jpg", b"just some text\n", "image/jpeg")}}, 400, "bad_image"),
        (
            "wrong content type",
            {"content": cat_jpeg, "headers": {"content-type": "text/plain"}},
            415,
            "unsupported_media_type",
        ),
        (
            "png claiming 50000x50000",
            {"content": crafted_png(50_000, 50_000), "headers": {"content-type": "image/png"}},
            413,
            "payload_too_large",
        ),
        ("gif", {"content": _pil(Image.fromarray(cat), "GIF"), "headers": {"content-type": "image/gif"}}, 200, None),
        ("16-bit png", {"content": sixteen, "headers": {"content-type": "image/png"}}, 200, None),
        ("cmyk jpeg", {"content": _pil(Image.fromarray(cat).convert("CMYK"), "JPEG"), **raw}, 200, None),
        ("exif-rotated photo", {"content": _pil(rotated, "JPEG", exif=exif.tobytes()), **raw}, 200, None),
        (
            "1x1 image",
            {"content": _pil(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"), "headers": {"content-type": "image/png"}},
            200,
            None,
        ),
        ("multipart with 1000 parts", {"files": many}, 400, "bad_request"),
        ("invalid top_k", {"content": cat_jpeg, "params": {"top_k": "0"}, **raw}, 422, "invalid_parameters"),
        ("unknown query parameter", {"content": cat_jpeg, "params": {"topk": "3"}, **raw}, 422, "invalid_parameters"),
    ]


async def test_bad_input_gets_clear_errors_and_harms_nothing_else(
    gateway_factory: Callable[..., Settings], cat_jpeg: bytes
) -> None:
    async with running_gateway(gateway_factory(max_delay=0.01)) as client:
        stop = asyncio.Event()

        async def good_traffic() -> list[int]:
            statuses = []
            while not stop.is_set():
                r = await client.post("/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
                statuses.append(r.status_code)
                assert r.json()["results"][0]["labels"][0]["index"] in CAT_CLASSES
            return statuses

        background = [asyncio.create_task(good_traffic()) for _ in range(3)]
        outcomes = {}
        for case, kwargs, _status, code in corpus():
            response: httpx.Response = await client.post("/classify", **kwargs)
            body = response.json()
            outcomes[case] = (response.status_code, body.get("error"))
            if code is None:
                assert response.status_code == 200, (case, body)
            else:
                assert set(body) == {"error", "detail", "request_id"}, (case, body)
                assert body["request_id"] == response.headers["x-request-id"], case
                assert body["detail"], case
            if case == "exif-rotated photo":
                assert body["results"][0]["labels"][0]["index"] in CAT_CLASSES  # labelled as shown upright
        stop.set()
        good = [s for task in background for s in await task]
    assert outcomes == {case: (status, code) for case, _, status, code in corpus()}
    assert good
    assert set(good) == {200}
