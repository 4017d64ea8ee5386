"""Requests refused from their head (``service.http.early``, ``service.http.refusing``), on a real
uvicorn server over raw sockets: answered before their body is read, without reaching the app,
their connection kept and left unread until ``Retry-After`` (a client that sends again at once
waits), or closed where keeping it would mean draining an upload."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.http.refusing import DRAIN_LIMIT
from service.serving.fair import RESERVATION_SECONDS, Admission
from service.settings import Settings
from tests.conftest import GatewayClient, png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
PNG = png_bytes(solid_image(7, 32))


def head(path: str = "/classify", length: int = len(PNG), *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", "content-type: image/png", f"content-length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP answer: its status line, headers (lower-case names) and body."""
    raw = await reader.readuntil(b"\r\n\r\n")
    status, *lines = raw.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status.encode(), headers, body


@asynccontextmanager
async def full_gateway(
    settings: Settings, key: str | None = None
) -> AsyncIterator[tuple[GatewayClient, FakeBackend, int]]:
    """A gateway admitting one request at a time, with that one held in the backend: the next is
    refused (429). Yields the client (sending ``key``), the backend (``gate.set()`` lets the held one
    finish) and the port."""
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    async with running_gateway(settings, backend) as client:
        if key is not None:
            client.headers["x-api-key"] = key
        held = asyncio.create_task(client.post("/classify", content=PNG, headers={"content-type": "image/png"}))
        await backend.wait_for_batches(1)
        assert client.base_url.port is not None
        try:
            yield client, backend, client.base_url.port
        finally:
            backend.gate.set()
            assert (await held).status_code == 200


def _metric(text: str, name: str, *labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_full_gateway_refuses_from_the_head_before_the_body_is_sent(gateway_factory: MakeSettings) -> None:
    """Only the head of a 5 MiB upload is sent: the 429 comes at once, in the gateway's shape, with
    Retry-After and the client's request id, says ``Connection: close`` (the upload is not drained),
    and the connection closes though the body never comes. It is counted as the app counts refusals."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (client, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head("/classify", 5 * 1024 * 1024, "x-request-id: mine-1"))
        async with asyncio.timeout(2):
            status, headers, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 429")
        assert headers["connection"] == "close"
        assert int(headers["retry-after"]) >= 1
        assert headers["x-request-id"] == "mine-1"
        error = json.loads(body)
        assert error["error"] == "queue_full"
        assert error["request_id"] == "mine-1"
        async with asyncio.timeout(4):  # closed without the body: at most LINGER_SECONDS later
            assert await reader.read() == b""
        writer.close()
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "gateway_rejections_total", 'reason="queue_full"') >= 1
        assert _metric(metrics, "gateway_http_requests_total", 'route="/classify"', 'status="429"') >= 1


async def test_a_client_that_sends_again_at_once_is_not_read_before_retry_after(gateway_factory: MakeSettings) -> None:
    """A small request (its body in hand) refused: the connection is kept alive; a second request sent
    at once, ignoring Retry-After, is not read until it has passed: then it is served, the slot freed."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1, request_timeout=2.0)
    async with full_gateway(settings) as (_, backend, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head() + PNG)
        status, headers, _ = await answer(reader)
        refused_at = time.monotonic()
        assert status.startswith(b"HTTP/1.1 429")
        assert "connection" not in headers
        retry = int(headers["retry-after"])
        writer.write(head() + PNG)  # at once
        await asyncio.sleep(0.2)
        backend.gate.set()  # room now, but this connection is not read before its Retry-After
        async with asyncio.timeout(retry + 3):
            status, _, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 200"), body
        assert time.monotonic() - refused_at >= retry - 0.05
        writer.close()


async def test_a_refused_upload_within_the_drain_limit_keeps_its_connection(gateway_factory: MakeSettings) -> None:
    """The head of a request whose 200 KB body comes after the refusal: 429 at once, kept alive; the
    body is then sent, and the next request on the connection is answered (after Retry-After)."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    body = b"\0" * 200_000
    assert len(body) <= DRAIN_LIMIT
    settings = settings.model_copy(update={"request_timeout": 2.0})
    async with full_gateway(settings) as (_, backend, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head("/classify", len(body)))
        async with asyncio.timeout(2):
            status, headers, _ = await answer(reader)
        assert status.startswith(b"HTTP/1.1 429")
        assert "connection" not in headers
        backend.gate.set()
        writer.write(body + head() + PNG)
        async with asyncio.timeout(int(headers["retry-after"]) + 3):
            status, _, answered = await answer(reader)
        assert status.startswith(b"HTTP/1.1 200"), answered
        writer.close()


async def test_a_client_waiting_for_100_continue_is_refused_and_closed(gateway_factory: MakeSettings) -> None:
    """``Expect: 100-continue``: no 100, the 429 with ``Connection: close`` (its body may never come)."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head("/classify", len(PNG), "expect: 100-continue"))
        async with asyncio.timeout(2):
            status, headers, _ = await answer(reader)
        assert status.startswith(b"HTTP/1.1 429")
        assert headers["connection"] == "close"
        async with asyncio.timeout(4):
            assert await reader.read() == b""
        writer.close()


async def test_the_protocol_routes_are_refused_in_the_protocols_shape(gateway_factory: MakeSettings) -> None:
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (client, _, port):
        model = client.app.state.gateway.models.default.name
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head(f"/v2/models/{model}/infer", 2) + b"{}")
        status, _, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 429")
        assert set(json.loads(body)) == {"error"}
        writer.close()


async def test_a_caller_without_a_key_learns_nothing_of_the_load(gateway_factory: MakeSettings) -> None:
    """With API keys on, a full gateway still answers a request without a valid key 401 (the app's
    answer), and one with a key 429 from its head."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1, api_keys="k1")
    async with full_gateway(settings, key="k1") as (client, _, _):
        anonymous = await httpx.AsyncClient(base_url=str(client.base_url)).post(
            "/classify", content=PNG, headers={"content-type": "image/png"}
        )
        assert anonymous.status_code == 401
        refused = await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
        assert refused.status_code == 429


async def test_a_body_declared_over_the_limit_is_refused_and_closed_unread(gateway_factory: MakeSettings) -> None:
    """413 from Content-Length alone, with ``Connection: close``, whatever the load."""
    settings = gateway_factory(backend="fake", max_body_bytes=64 * 1024)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(head("/classify", 10 * 1024 * 1024))
        async with asyncio.timeout(2):
            status, headers, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 413")
        assert headers["connection"] == "close"
        assert json.loads(body)["error"] == "payload_too_large"
        writer.close()


def _drained(monkeypatch: pytest.MonkeyPatch, spacing: float) -> tuple[Admission, list[float]]:
    """An admission of 4 with 8 requests entered and 4 finished ``spacing`` seconds apart, on a
    clock the test moves (``now[0]``)."""
    now = [1000.0]
    monkeypatch.setattr("service.serving.fair.time.monotonic", lambda: now[0])
    admission = Admission(4, {"m": 1.0}, longest=30.0)
    for _ in range(8):
        admission.enter("m")
    for _ in range(4):
        now[0] += spacing
        admission.leave("m")
    return admission, now


@pytest.mark.parametrize(("spacing", "low", "high"), [(0.01, 1, 1), (1.0, 4, 6)])
def test_retry_after_is_the_time_the_requests_in_progress_take_to_drain(
    monkeypatch: pytest.MonkeyPatch, spacing: float, low: int, high: int
) -> None:
    """4 requests in progress, the latest ones finished ``spacing`` apart: Retry-After is their
    drain time (4 x spacing) spread by up to half again, in whole seconds, at least 1."""
    admission, _ = _drained(monkeypatch, spacing)
    assert admission.total == 4
    retries = {admission.retry_after() for _ in range(50)}
    assert min(retries) >= low
    assert max(retries) <= high


def test_a_stalled_backend_reads_as_a_long_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing finished for 20 s: the drain is measured up to now (not from the last finish), so
    Retry-After grows, and stays within the longest a request may take."""
    admission, now = _drained(monkeypatch, 0.01)
    now[0] += 20
    assert 20 <= admission.retry_after() <= 30


async def test_a_request_admitted_from_its_head_keeps_its_slot_while_its_body_arrives(
    gateway_factory: MakeSettings,
) -> None:
    """One slot. A's head is admitted and its body comes later: B, whole and sent meanwhile, is refused
    from its head (A's slot is held for it), and A, once its body is in, is served: nobody reads a
    body only to refuse it after."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(head() + PNG[:10])
        await asyncio.sleep(0.05)  # within RESERVATION_SECONDS
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        other_writer.write(head() + PNG)
        async with asyncio.timeout(2):
            status, _, _ = await answer(other_reader)
        assert status.startswith(b"HTTP/1.1 429")
        writer.write(PNG[10:])
        async with asyncio.timeout(5):
            status, _, body = await answer(reader)
        assert status.startswith(b"HTTP/1.1 200"), body
        writer.close()
        other_writer.close()


async def test_a_slow_sender_holds_no_slot(gateway_factory: MakeSettings) -> None:
    """A head whose body does not come within RESERVATION_SECONDS loses its slot: another request is
    admitted and served."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        _reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(head() + PNG[:10])
        await asyncio.sleep(RESERVATION_SECONDS + 0.2)
        served = await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
        assert served.status_code == 200
        writer.close()


def test_a_reservation_is_claimed_once_released_once_and_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("service.serving.fair.time.monotonic", lambda: now[0])
    admission = Admission(4, {"m": 1.0})
    for _ in range(2):
        admission.enter("m")
    kept, lost = admission.reserve_slot("m"), admission.reserve_slot("m")
    assert not admission.room("m")
    assert admission.claim(kept)
    assert not admission.claim(kept)
    kept.release()  # claimed: its slot is the request's, left when it finishes
    assert admission.total == 4
    now[0] += RESERVATION_SECONDS + 0.1
    assert admission.room("m")  # the unclaimed one expired
    assert not lost.holds("m")
    assert not admission.claim(lost)
    lost.release()
    assert admission.total == 3
    assert not admission.finished  # a reservation given back is not a request finished


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/v1/models/efficientnet-lite0/versions/999/classify", 404),
        ("/v1/models/efficientnet-lite0/embed", 400),
        ("/classify?top_k=abc", 422),
        ("/v2/models/efficientnet-lite0/infer?bogus=1", 422),
    ],
)
async def test_a_request_that_can_never_succeed_gets_its_own_error_not_429(
    gateway_factory: MakeSettings, path: str, status: int
) -> None:
    """A full gateway still answers what the app refuses before admission with that error (a 429
    would have its client retry for ever)."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head(path) + PNG)
        async with asyncio.timeout(5):
            answered, _, body = await answer(reader)
        assert answered.startswith(f"HTTP/1.1 {status}".encode()), body
        writer.close()


async def test_an_upgrade_request_is_left_to_the_app(
    gateway_factory: MakeSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A head asking for a WebSocket upgrade while the gateway is full is not refused from its head
    (the protocol's upgrade path read a scope such a refusal had not made: KeyError in the loop)."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (_, _, port):
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        upgrade = ("connection: Upgrade", "upgrade: websocket", "sec-websocket-version: 13")
        writer.write(head("/classify", len(PNG), *upgrade, "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==") + PNG)
        await asyncio.sleep(0.5)
        writer.close()
    assert not [r for r in caplog.records if "KeyError" in r.getMessage() or (r.exc_info and r.exc_info[0] is KeyError)]


async def test_an_http_1_0_client_is_answered_and_closed(gateway_factory: MakeSettings) -> None:
    """HTTP/1.0, even with ``Connection: keep-alive``: 429 with ``Connection: close`` and the
    connection closed at once (an HTTP/1.0 client may read its answer until the close)."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=1)
    async with full_gateway(settings) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head().replace(b"HTTP/1.1", b"HTTP/1.0").replace(b"host: x", b"connection: keep-alive") + PNG)
        async with asyncio.timeout(2):
            status, headers, _ = await answer(reader)
            assert await reader.read() == b""
        assert status.startswith(b"HTTP/1.1 429")
        assert headers["connection"] == "close"
        writer.close()


async def test_a_key_over_its_own_quota_gives_its_reserved_slot_back(gateway_factory: MakeSettings) -> None:
    """Key A (concurrency 1) has one request in progress; its second is admitted from its head (a
    slot reserved), then refused by its key's quota: the slot goes back at once, and key B's request
    is admitted, not refused for a slot nobody uses."""
    settings = gateway_factory(backend="fake", max_concurrent_requests=2, api_keys="aaaa concurrency=1,bbbb")
    async with full_gateway(settings, key="aaaa") as (client, backend, _):
        over = await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
        assert over.status_code == 429
        assert over.json()["error"] == "quota_exceeded"
        other = asyncio.create_task(
            client.post("/classify", content=PNG, headers={"content-type": "image/png", "x-api-key": "bbbb"})
        )
        async with asyncio.timeout(5):
            await backend.wait_for_batches(2)  # B's image reached the backend: it was admitted
        assert backend.gate is not None
        backend.gate.set()
        assert (await other).status_code == 200
