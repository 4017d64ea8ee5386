"""The HTTP API on a real uvicorn server: real photos through the embedded model, and every error
path through the fake backend."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from loadtests.harness.photos import noise_png
from service.backends.base import Images
from service.backends.fake import FakeBackend
from service.settings import Settings
from tests.conftest import (
    CAT_CLASSES,
    ESPRESSO,
    crafted_png,
    png_bytes,
    readyz_becomes,
    running_gateway,
    solid_image,
)

MakeSettings = Callable[..., Settings]


def png_of_class(value: int) -> bytes:
    """A PNG the fake backend classifies as class ``value`` (its first pixel's red channel)."""
    return png_bytes(solid_image(value, 32))


def error_of(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error", "detail", "request_id"}
    assert body["detail"]
    assert body["request_id"] == response.headers["x-request-id"]
    return response.status_code, body["error"]


async def test_real_photos_get_the_right_labels(
    gateway_factory: MakeSettings, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """Multipart with two photos, batched together: a cat and an espresso, with model name and version."""
    async with running_gateway(gateway_factory()) as client:
        response = await client.post(
            "/classify",
            params={"top_k": 3},
            files=[("file", ("cat.jpg", cat_jpeg, "image/jpeg")), ("file", ("coffee.jpg", coffee_jpeg, "image/jpeg"))],
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == {"name": "efficientnet-lite0", "version": "1", "random_weights": False}
        cat, coffee = body["results"]
        assert cat["filename"] == "cat.jpg"
        assert len(cat["labels"]) == 3
        assert cat["labels"][0]["index"] in CAT_CLASSES
        assert "cat" in cat["labels"][0]["label"]
        assert coffee["labels"][0] == {"index": ESPRESSO, "label": "espresso", "score": pytest.approx(0.94, abs=0.05)}
        scores = [label["score"] for label in cat["labels"]]
        assert scores == sorted(scores, reverse=True)

        raw = await client.post("/classify", content=coffee_jpeg, headers={"content-type": "image/jpeg"})
        assert raw.status_code == 200
        assert raw.json()["results"][0]["labels"][0]["index"] == ESPRESSO
        assert len(raw.json()["results"][0]["labels"]) == 5  # default top_k


async def test_concurrent_requests_are_batched_and_answered_correctly(gateway_factory: MakeSettings) -> None:
    fake = FakeBackend()
    settings = gateway_factory(backend="fake", max_batch_size=8, max_delay=0.01)
    async with running_gateway(settings, fake) as client:
        responses = await asyncio.gather(
            *(client.post("/classify", files={"file": ("x.png", png_of_class(v), "image/png")}) for v in range(40))
        )
    assert [r.json()["results"][0]["labels"][0]["index"] for r in responses] == list(range(40))
    assert sum(fake.batches) == 40
    assert max(fake.batches) > 1  # concurrency did produce batches


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({"content": b"", "headers": {"content-type": "image/jpeg"}}, 400, "bad_image"),
        ({"content": b"plain text", "headers": {"content-type": "image/jpeg"}}, 400, "bad_image"),
        ({"content": b"plain text", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        ({"files": {"file": ("a.txt", b"hello", "text/plain")}}, 415, "unsupported_media_type"),
        ({"files": {"photo": ("a.png", b"x", "image/png")}}, 400, "bad_request"),
        ({"data": {"file": "not a file"}, "files": {"file": ("a.png", b"x", "image/png")}}, 400, "bad_request"),
        ({"content": crafted_png(50_000, 50_000), "headers": {"content-type": "image/png"}}, 413, "payload_too_large"),
    ],
    ids=["empty", "text-as-jpeg", "text-content-type", "text-part", "wrong-field", "text-field", "pixel-bomb"],
)
async def test_bad_input_gets_a_clear_error(
    gateway_factory: MakeSettings, kwargs: dict[str, object], status: int, code: str
) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        response = await client.post("/classify", **kwargs)  # type: ignore[arg-type]
        assert error_of(response) == (status, code)
        if code == "bad_request" and "data" in kwargs:
            assert "text field" in response.json()["detail"]


@pytest.mark.parametrize("top_k", ["0", "21", "five", "1_0", "٣", ""])
async def test_invalid_top_k_is_422(gateway_factory: MakeSettings, top_k: str) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        response = await client.post(
            "/classify", params={"top_k": top_k}, content=png_of_class(1), headers={"content-type": "image/png"}
        )
        assert error_of(response) == (422, "invalid_parameters")
        assert "top_k" in response.json()["detail"]


async def test_body_over_the_limit_is_413_declared_or_streamed(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake", max_body_bytes=4096), FakeBackend()) as client:
        declared = await client.post("/classify", content=b"\0" * 5000, headers={"content-type": "image/png"})
        assert error_of(declared) == (413, "payload_too_large")

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b"\0" * 1000

        streamed = await client.post("/classify", content=chunks(), headers={"content-type": "image/png"})
        assert error_of(streamed) == (413, "payload_too_large")
        ok = await client.post("/classify", content=png_of_class(3), headers={"content-type": "image/png"})
        assert ok.status_code == 200


async def test_too_many_images_is_refused(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake", max_images_per_request=3), FakeBackend()) as client:
        files = [("file", (f"{i}.png", png_of_class(i), "image/png")) for i in range(4)]
        response = await client.post("/classify", files=files)
        assert error_of(response) == (400, "bad_request")
        detail = response.json()["detail"]
        assert detail == "over 3 'file' parts; at most 3 images per request (GATEWAY_MAX_IMAGES_PER_REQUEST)"
        assert "malformed" not in detail  # a limit, not a broken body
        fields = [("file", (f"{i}.png", png_of_class(i), "image/png")) for i in range(2)]
        texts = {f"note{i}": "x" for i in range(4)}
        response = await client.post("/classify", files=fields, data=texts)
        assert error_of(response) == (400, "bad_request")
        detail = response.json()["detail"]
        assert detail.startswith("over 3 text fields; a body may have at most as many parts as images per request")
        assert "only 'file' parts are read" in detail  # the text fields are the problem, not the images
        listed = await client.post("/classify", content=b"x", headers={"content-type": "text/plain"})
        assert error_of(listed)[0] == 415
        assert listed.json()["detail"].endswith("or application/json with image URLs")


async def test_one_bad_image_fails_its_request_only(gateway_factory: MakeSettings) -> None:
    """A request with one undecodable image is refused naming it; concurrent requests, which share
    batches with it, all succeed, and nothing of the bad request reaches the backend."""
    fake = FakeBackend()
    async with running_gateway(gateway_factory(backend="fake", max_delay=0.02), fake) as client:
        good = [client.post("/classify", files={"file": ("g.png", png_of_class(v), "image/png")}) for v in range(20)]
        bad = client.post(
            "/classify",
            files=[
                ("file", ("ok.png", png_of_class(99), "image/png")),
                ("file", ("broken.jpg", b"\xff\xd8\xffjunk", "image/jpeg")),
            ],
        )
        *good_responses, bad_response = await asyncio.gather(*good, bad)
    assert error_of(bad_response) == (400, "bad_image")
    assert "image 2 of 2 (broken.jpg)" in bad_response.json()["detail"]
    assert [r.status_code for r in good_responses] == [200] * 20
    assert sum(fake.batches) == 20


async def test_queue_full_is_429_with_retry_after(gateway_factory: MakeSettings) -> None:
    fake = FakeBackend()
    fake.gate = asyncio.Event()
    settings = gateway_factory(backend="fake", max_queue_size=2, max_images_per_request=2, max_inflight_batches=1)
    async with running_gateway(settings, fake) as client:
        first = asyncio.create_task(
            client.post("/classify", content=png_of_class(1), headers={"content-type": "image/png"})
        )
        await fake.wait_for_batches(1)
        files = [("file", (f"{i}.png", png_of_class(i), "image/png")) for i in range(2)]
        queued = asyncio.create_task(client.post("/classify", files=files))
        async with asyncio.timeout(10):  # black-box: wait until the server itself reports 2 queued
            depth = 'gateway_batcher_queue_depth{model="efficientnet-lite0",version="1"} 2.0'
            while depth not in (await client.get("/metrics")).text:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        rejected = await client.post("/classify", content=png_of_class(3), headers={"content-type": "image/png"})
        assert error_of(rejected) == (429, "queue_full")
        assert rejected.headers["retry-after"] == "1"
        fake.gate.set()
        assert (await first).status_code == 200
        assert (await queued).status_code == 200


async def test_deadline_is_504(gateway_factory: MakeSettings) -> None:
    fake = FakeBackend()
    fake.gate = asyncio.Event()
    async with running_gateway(gateway_factory(backend="fake", request_timeout=0.2), fake) as client:
        response = await client.post("/classify", content=png_of_class(1), headers={"content-type": "image/png"})
        assert error_of(response) == (504, "deadline_exceeded")
        fake.gate.set()


async def test_backend_failure_is_500_and_not_ready_is_503(gateway_factory: MakeSettings) -> None:
    fake = FakeBackend()
    async with running_gateway(gateway_factory(backend="fake", readiness_interval=0.1), fake) as client:
        fake.fail_next = RuntimeError("device lost")
        failed = await client.post("/classify", content=png_of_class(1), headers={"content-type": "image/png"})
        assert error_of(failed) == (500, "backend_error")
        # the exception's text (it may name a path, an address) is logged; the client learns its kind
        assert failed.json()["detail"] == "the backend failed on the batch (RuntimeError)"

        ready = (await client.get("/readyz")).json()
        assert ready["ready"] is True
        assert {k: ready["checks"][k] for k in ("backend", "batcher")} == {"backend": "fake: ok", "batcher": "ok"}
        fake.is_ready = False
        readyz = await readyz_becomes(client, 503)
        assert readyz.json()["checks"]["backend"] == "fake: fake backend marked not ready"
        assert (await client.get("/healthz")).status_code == 200


async def test_metrics_count_requests_batches_and_rejections(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        for v in range(3):
            await client.post("/classify", content=png_of_class(v), headers={"content-type": "image/png"})
        await client.post("/classify", content=b"junk", headers={"content-type": "image/png"})
        text = (await client.get("/metrics")).text
    assert 'gateway_http_requests_total{method="POST",route="/classify",status="200"} 3.0' in text
    assert 'gateway_http_requests_total{method="POST",route="/classify",status="400"} 1.0' in text
    assert 'gateway_rejections_total{reason="bad_image"} 1.0' in text
    assert 'gateway_images_classified_total{mode="online",model="efficientnet-lite0",version="1"} 3.0' in text
    assert 'gateway_batch_size_sum{model="efficientnet-lite0",version="1"} 3.0' in text
    assert 'gateway_backend_duration_seconds_count{backend="fake",model="efficientnet-lite0",version="1"} 3.0' in text
    assert "gateway_preprocess_duration_seconds_count 4.0" in text
    duration = "gateway_http_request_duration_seconds_count"
    assert f'{duration}{{route="/classify",status="200"}} 3.0' in text
    assert f'{duration}{{route="/classify",status="400"}} 1.0' in text  # the label of gateway_http_requests_total


async def test_openapi_documents_both_body_forms_and_errors(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        schema = (await client.get("/openapi.json")).json()
        missing = await client.get("/nope")
    post = schema["paths"]["/classify"]["post"]
    assert {"multipart/form-data", "image/jpeg", "image/png"} <= set(post["requestBody"]["content"])
    assert {"200", "400", "413", "415", "422", "429", "503", "504"} <= set(post["responses"])
    assert error_of(missing) == (404, "not_found")


class NonFinite(FakeBackend):
    """Scores NaN for class-13 images and inf for class-14 ones; others as the fake does."""

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        scores = await super().infer(images, timeout=timeout)
        red = np.array([image[0, 0, 0] for image in images])
        scores[red == 13] = np.nan
        scores[red == 14, 0] = np.inf
        return scores


async def test_non_finite_scores_are_a_json_500_for_that_image_only(gateway_factory: MakeSettings) -> None:
    """NaN or inf from the backend is a backend_error with the JSON body (before: a plain-text 500
    from the JSON encoder); requests sharing the batch are answered normally."""
    backend = NonFinite()
    backend.gate = asyncio.Event()
    async with running_gateway(gateway_factory(backend="fake", max_batch_size=8), backend) as client:

        async def post(value: int) -> httpx.Response:
            return await client.post("/classify", content=png_of_class(value), headers={"content-type": "image/png"})

        first = asyncio.create_task(post(1))
        await backend.wait_for_batches(1)
        rest = [asyncio.create_task(post(v)) for v in (13, 14, 5)]
        await asyncio.sleep(0.2)  # queued together behind the gated batch
        backend.gate.set()
        answers = [await first] + [await r for r in rest]
    assert [a.status_code for a in answers] == [200, 500, 500, 200]
    for bad in answers[1:3]:
        assert error_of(bad) == (500, "backend_error")
        assert "non-finite" in bad.json()["detail"]
    assert answers[3].json()["results"][0]["labels"][0]["index"] == 5
    assert max(backend.batches) == 3  # the three shared one batch


async def test_filenames_over_255_bytes_are_refused(gateway_factory: MakeSettings) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        long_name = "é" * 128 + ".png"  # 260 bytes in UTF-8
        refused = await client.post("/classify", files=[("file", (long_name, png_of_class(1), "image/png"))])
        assert error_of(refused) == (400, "bad_request")
        assert "255 bytes" in refused.json()["detail"]
        fine = await client.post("/classify", files=[("file", ("a" * 251 + ".png", png_of_class(1), "image/png"))])
        assert fine.status_code == 200


async def test_an_unexpected_failure_is_a_json_500_and_the_gateway_goes_on(
    gateway_factory: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/classify is served outside FastAPI's error layer: a bug in it still answers the gateway's
    JSON 500 (not uvicorn's plain text), counts it, and the next request is served."""
    from service.http.answers import Answers

    real = Answers.render
    calls = 0

    def once_broken(self: object, results: list[object]) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        return real(self, results)  # type: ignore[arg-type]

    monkeypatch.setattr(Answers, "render", once_broken)
    async with running_gateway(gateway_factory(backend="fake", metrics_public=True), FakeBackend()) as client:
        broken = await client.post("/classify", content=png_of_class(3), headers={"content-type": "image/png"})
        assert error_of(broken) == (500, "internal_error")
        served = await client.post("/classify", content=png_of_class(3), headers={"content-type": "image/png"})
        assert served.status_code == 200
        assert served.json()["results"][0]["labels"][0]["index"] == 3
        metrics = (await client.get("/metrics")).text
        assert 'gateway_http_requests_total{method="POST",route="/classify",status="500"} 1.0' in metrics
        assert 'gateway_rejections_total{reason="internal_error"} 1.0' in metrics


async def test_large_images_take_turns_for_decoder_memory(gateway_factory: MakeSettings) -> None:
    """Eight decode threads, decoder memory for one of these images: concurrent requests are all
    served (none refused or failed for memory), the waits are counted, and nothing stays reserved."""
    png = noise_png(1200, 5)  # reckoned at 2 x 1200 x 1200 x 3 = 8.6 MB
    settings = gateway_factory(
        backend="fake", preprocess_workers=8, max_image_bytes=9_000_000, max_decode_bytes=9_000_000
    )
    async with running_gateway(settings, FakeBackend()) as client:
        responses = await asyncio.gather(
            *(client.post("/classify", content=png, headers={"content-type": "image/png"}) for _ in range(8))
        )
        assert [r.status_code for r in responses] == [200] * 8
        metrics = (await client.get("/metrics")).text
    waits = re.search(r"^gateway_decode_budget_waits_total (\S+)$", metrics, re.M)
    reserved = re.search(r"^gateway_decode_reserved_bytes (\S+)$", metrics, re.M)
    assert waits is not None
    assert float(waits.group(1)) >= 1
    assert reserved is not None
    assert float(reserved.group(1)) == 0


class WithCells(FakeBackend):
    """A backend that hands out memory to decode into (as the shared engine's client does) and
    records, for each image it is given, whether it is one of those cells."""

    def __init__(self, cells: int) -> None:
        super().__init__()
        import mmap

        from service.backends.image_cells import ImageCells

        self.cells = ImageCells(mmap.mmap(-1, max(1, cells) * 224 * 224 * 3), (224, 224, 3), 0, cells)
        self.in_cells: list[bool] = []

    def allocate_image(self) -> np.ndarray | None:
        return self.cells.allocate()

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        self.in_cells += [self.cells.index(image) is not None for image in images]
        return await super().infer(images, timeout=timeout)


@pytest.mark.parametrize("cells", [64, 0])
async def test_images_are_decoded_into_the_memory_the_backend_hands_out(
    gateway_factory: MakeSettings, cells: int
) -> None:
    """Every image of every kind of request is decoded straight into a cell of the backend's when
    it has one free (the shared engine then gets the batch with no copy); with none free, the same
    answers from images decoded where they always were."""
    backend = WithCells(cells)
    async with running_gateway(gateway_factory(backend="fake", max_batch_size=8), backend) as client:
        one = await client.post("/classify", content=png_of_class(5), headers={"content-type": "image/png"})
        files = [("file", (f"{v}.png", png_of_class(v), "image/png")) for v in (3, 7)]
        several = await client.post("/classify", files=files)
    assert one.status_code == several.status_code == 200
    assert [r["labels"][0]["index"] for r in [*one.json()["results"], *several.json()["results"]]] == [5, 3, 7]
    assert backend.in_cells == [cells > 0] * 3


async def test_a_refused_content_type_is_told_every_type_accepted(gateway_factory: MakeSettings) -> None:
    """The 415 lists what is accepted, ``application/octet-stream`` included, and that type is
    indeed accepted, for a body as for a ``file`` part."""
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        refused = await client.post("/classify", content=png_of_class(1), headers={"content-type": "text/plain"})
        assert error_of(refused) == (415, "unsupported_media_type")
        assert "application/octet-stream" in refused.json()["detail"]
        part = await client.post("/classify", files={"file": ("a.txt", png_of_class(1), "text/plain")})
        assert error_of(part) == (415, "unsupported_media_type")
        assert "application/octet-stream" in part.json()["detail"]
        octets = {"content-type": "application/octet-stream"}
        assert (await client.post("/classify", content=png_of_class(1), headers=octets)).status_code == 200
        as_part = await client.post("/classify", files={"file": ("a", png_of_class(1), "application/octet-stream")})
        assert as_part.status_code == 200
