"""Receiving bodies on a real uvicorn server: slow senders, the body budget, and early refusals
counted like every other rejection."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.errors import QueueFull
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
PNG = png_bytes(solid_image(7, 32))


def _port(client: httpx.AsyncClient) -> int:
    port = client.base_url.port
    assert port is not None
    return port


async def _trickle(port: int, declared: int, stop: asyncio.Event) -> tuple[int, dict[str, str], float]:
    """Send headers and then a byte every 100 ms until the server answers; return its status, JSON
    body and how long the connection was held."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n"
        + f"content-length: {declared}\r\n\r\n".encode()
        + PNG[:16]
    )
    await writer.drain()

    async def send_slowly() -> None:
        for byte in PNG[16:]:
            if stop.is_set():
                return
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.1)

    sender = asyncio.create_task(send_slowly())
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length")
        body = json.loads(await reader.readexactly(length))
        return int(lines[0].split()[1]), body, time.monotonic() - started
    finally:
        sender.cancel()
        writer.close()


async def test_slow_uploads_cannot_starve_other_clients(gateway_factory: MakeSettings) -> None:
    """70 connections trickling a body (more than the 8 admission slots) leave every other client
    served; each trickler admitted gets 408 with the JSON error once GATEWAY_BODY_TIMEOUT has
    passed, the others 429 from their heads.
    Before, the tricklers held every slot and everyone else got 429 for as long as they liked."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=8, body_timeout=2.0)
    async with running_gateway(settings, FakeBackend()) as client:
        stop = asyncio.Event()
        tricklers = [asyncio.create_task(_trickle(_port(client), len(PNG), stop)) for _ in range(70)]
        await asyncio.sleep(0.5)  # every trickler has sent its headers and is sending its body
        answers = [
            await client.post("/classify", content=PNG, headers={"content-type": "image/png"}) for _ in range(20)
        ]
        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers if a.status_code != 200]
        outcomes = await asyncio.gather(*tricklers)
        stop.set()
        # the tricklers admitted from their heads (the 8 slots were free) hold them a quarter of a
        # second at most (service.serving.fair), then get 408; the others were refused from their
        # heads at once, as any request past the slots is
        timed_out = [(body, held) for status, body, held in outcomes if status == 408]
        refused = [body for status, body, _ in outcomes if status == 429]
        assert len(timed_out) + len(refused) == 70
        assert len(timed_out) >= 8
        for body, held in timed_out:
            assert body["error"] == "request_timeout"
            assert "did not arrive within 2 s" in body["detail"]
            assert len(body["request_id"]) == 16  # the id the request was given at the edge
            assert 1.9 <= held <= 4.0
        assert all(body["error"] == "queue_full" for body in refused)
        metrics = (await client.get("/metrics")).text
        assert f'gateway_rejections_total{{reason="request_timeout"}} {len(timed_out)}.0' in metrics


async def test_bodies_being_handled_are_bounded_in_bytes(gateway_factory: MakeSettings) -> None:
    """While one upload holds most of the body budget, a second that would pass it gets 429; once
    the first has finished, the same body is served."""
    settings = gateway_factory(
        backend="fake", max_body_bytes=64 * 1024, max_buffered_body_bytes=100 * 1024, body_timeout=5.0
    )
    big = PNG + b"\0" * (60 * 1024)  # trailing bytes after IEND are ignored by the decoder
    async with running_gateway(settings, FakeBackend()) as client:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(client))
        writer.write(
            b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n"
            + f"content-length: {len(big)}\r\n\r\n".encode()
            + big[:-10]
        )
        await writer.drain()
        await asyncio.sleep(0.3)  # the held upload's bytes are in the budget
        refused = await client.post("/classify", content=big, headers={"content-type": "image/png"})
        assert refused.status_code == 429
        assert refused.json()["error"] == "queue_full"
        writer.write(big[-10:])
        await writer.drain()
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
        served = await client.post("/classify", content=big, headers={"content-type": "image/png"})
        assert served.status_code == 200, served.text


async def _held_upload(port: int, path: str, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send all of ``body`` but its last 10 bytes: the upload stays in progress, its bytes held."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ncontent-length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body[:-10])
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("fair", [True, False])
async def test_a_flood_of_uploads_to_one_model_leaves_another_models_bytes(
    gateway_factory: MakeSettings, fair: bool
) -> None:
    """Two models share 100 KiB of body bytes (50 KiB each, 12.5 KiB of it kept for each while the
    other borrows). The flooded model holds a 60 KiB upload; its next, of 30 KiB, would leave the
    other less than its reserve, so it gets 429 naming the model; the other model's 12 KiB upload
    is served. First come, first served (``fair_sharing`` off), the flood's 30 KiB are taken and
    the other model's upload gets the 429."""
    settings = gateway_factory(
        backend="fake",
        models="efficientnet-lite0,trivial",
        max_body_bytes=64 * 1024,
        max_buffered_body_bytes=100 * 1024,
        body_timeout=10.0,
        fair_sharing=fair,
    )
    held, flood, other = (PNG + b"\0" * (size * 1024 - len(PNG)) for size in (60, 30, 12))
    async with running_gateway(settings) as client:
        port = _port(client)
        first = await _held_upload(port, "/classify", held)
        await asyncio.sleep(0.3)  # its bytes are in the budget
        second = await _held_upload(port, "/v1/models/efficientnet-lite0/classify", flood)
        await asyncio.sleep(0.3)
        answer = await client.post("/v1/models/trivial/classify", content=other, headers={"content-type": "image/png"})
        if fair:
            assert (await second[0].readuntil(b"\r\n")).startswith(b"HTTP/1.1 429")
            assert answer.status_code == 200, answer.text
        else:
            assert answer.status_code == 429
            assert "request bodies being handled hold over 102400 bytes" in answer.json()["detail"]
        for _reader, writer in (first, second):
            writer.close()
    if fair:
        second_body = (await second[0].read()).decode()
        assert "model 'efficientnet-lite0'" in second_body
        assert "borrow" in second_body


async def test_refusals_before_the_route_are_counted(gateway_factory: MakeSettings) -> None:
    """A 401 (no key) and a 413 from Content-Length are answered by middleware, before any route;
    they count in gateway_rejections_total like the route's own refusals."""
    settings = gateway_factory(backend="fake", api_keys="k1", max_body_bytes=4096, metrics_public=True)
    async with running_gateway(settings, FakeBackend()) as client:
        assert (await client.post("/classify", content=PNG, headers={"content-type": "image/png"})).status_code == 401
        too_big = await client.post(
            "/classify", content=b"\0" * 5000, headers={"content-type": "image/png", "x-api-key": "k1"}
        )
        assert too_big.status_code == 413
        metrics = (await client.get("/metrics")).text
        assert 'gateway_rejections_total{reason="unauthorized"} 1.0' in metrics
        assert 'gateway_rejections_total{reason="payload_too_large"} 1.0' in metrics


async def _slow_headers(port: int) -> tuple[bytes, float]:
    """Open a connection, send half a request line and headers, then nothing; return what the
    server sent before closing, and when it closed."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /classify HTTP/1.1\r\nhost: x\r\n")
    await writer.drain()
    answer = await reader.read()  # until the server closes
    writer.close()
    return answer, time.monotonic() - started


async def test_slow_headers_are_cut_off(gateway_factory: MakeSettings) -> None:
    """Connections that never finish their headers (or never send any) are answered 408 and closed
    after GATEWAY_HEADER_TIMEOUT, so they cannot pile up to max_connections; normal clients are
    served meanwhile. Before, uvicorn held them for as long as the client liked."""
    settings = gateway_factory(backend="fake", header_timeout=1.0, max_connections=60)
    async with running_gateway(settings, FakeBackend()) as client:
        port = _port(client)
        slow = [asyncio.create_task(_slow_headers(port)) for _ in range(40)]
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.2)
        ok = await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
        assert ok.status_code == 200
        for answer, held in await asyncio.gather(*slow):
            assert answer.startswith(b"HTTP/1.1 408")
            assert b'"error": "request_timeout"' in answer
            assert b"x-request-id: " in answer  # never reached the app: a new id, still answered
            assert 0.9 <= held <= 3.0
        async with asyncio.timeout(3):
            assert (await silent_reader.read()).startswith(b"HTTP/1.1 408")
        silent_writer.close()
        assert (await client.post("/classify", content=PNG, headers={"content-type": "image/png"})).status_code == 200


async def test_an_empty_last_chunk_is_never_refused_and_a_refusal_names_the_right_limit() -> None:
    """At the edge of the shared body bytes (model a borrowing, b within its guarantee, the total
    full): the empty chunk that ends a body (a chunked body's terminator in a packet of its own)
    takes nothing and passes; a byte more is refused, naming the total, not a's share."""
    from service.http.middleware import BodyBudget, BodyLimitMiddleware
    from service.metrics import Metrics
    from service.serving.fair import Admission

    shares = Admission(100, {"a": 1.0, "b": 1.0})
    shares.enter("a", 60)
    shares.enter("b", 40)
    budget = BodyBudget(100)
    budget.serve(shares, "a")
    bodies: list[bytes] = []

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        message = await receive()  # type: ignore[operator]
        bodies.append(message["body"])

    for chunk in (b"", b"x"):
        messages = iter([{"type": "http.request", "body": chunk, "more_body": False}])

        async def receive(messages: Iterator[dict[str, object]] = messages) -> dict[str, object]:
            return next(messages)

        middleware = BodyLimitMiddleware(app, max_bytes=1000, budget=budget, metrics=Metrics())  # type: ignore[arg-type]
        scope = {"type": "http", "path": "/v1/models/a/classify", "headers": []}
        if chunk:
            with pytest.raises(QueueFull, match="request bodies being handled hold over 100 bytes"):
                await middleware(scope, receive, None)  # type: ignore[arg-type]
        else:
            await middleware(scope, receive, None)  # type: ignore[arg-type]
    assert bodies == [b""]
    assert (shares.total, shares.active["a"]) == (100, 60)  # nothing left held by either request
