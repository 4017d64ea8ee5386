"""Hostile chunked request bodies at the byte level, on raw sockets to a real uvicorn running the
gateway's protocol (``service.http.protocol``): very many tiny chunks, chunk sizes that overflow,
chunk extensions, trailers, a chunked body with Content-Length, on ``/classify``, the Open Inference
Protocol's infer route and the job routes. Each gets a JSON 400/413 (or is served), in bounded
time, while other clients are served; and a ``hypothesis`` test sends generated requests."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from service.backends.fake import FakeBackend
from service.http.protocol import MAX_HEAD_BYTES, max_chunks
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
PNG = png_bytes(solid_image(7, 32))
MODEL = "efficientnet-lite0"
"""The gateway's default model (the fake backend serves it)."""
HEADS = {
    "classify": b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n",
    "v2-infer": f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode(),
    "job-status": b"GET /jobs/0123456789abcdef0123456789abcdef HTTP/1.1\r\nhost: x\r\n",
}
READS_NO_BODY = {"job-status"}
"""Routes that answer without reading a body: the bounds then close the connection after the answer."""
CHUNKED = b"transfer-encoding: chunked\r\n"
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
ANSWER_WITHIN = 4.0


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One whole response: status, headers, body (by Content-Length)."""
    async with asyncio.timeout(ANSWER_WITHIN):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ")[1]), headers, body


def _error_of(headers: dict[str, str], body: bytes) -> str:
    """The gateway's JSON error code of a refusal."""
    assert headers["content-type"] == "application/json"
    return str(json.loads(body)["error"])


def _check_refusal(route: str, answer: tuple[int, dict[str, str], bytes], status: int, error: str) -> None:
    """``answer`` is the refusal (``status``, ``error``) in the gateway's JSON; on a route that
    reads no body, it may be the route's own answer, given before the body was refused."""
    got, headers, body = answer
    if route in READS_NO_BODY and got == 404:
        assert _error_of(headers, body) == "not_found"
        return
    assert (got, _error_of(headers, body)) == (status, error), body


async def _send_until_answered(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, data: bytes, piece: int = 65536
) -> tuple[int, dict[str, str], bytes, int]:
    """Send ``data`` a piece at a time until it is all sent or the gateway answers (and closes);
    the answer, and how many bytes were sent before it came."""
    answer = asyncio.ensure_future(_answer(reader))
    sent = 0
    try:
        while sent < len(data) and not answer.done():
            writer.write(data[sent : sent + piece])
            sent += piece
            await writer.drain()
    except ConnectionError:
        pass  # it answered and closed while we were still sending
    status, headers, body = await answer
    return status, headers, body, min(sent, len(data))


async def _served_meanwhile(port: int) -> float:
    """Seconds another client's /healthz takes now."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEALTHZ)
    status, _, _ = await _answer(reader)
    writer.close()
    assert status == 200
    return time.perf_counter() - started


@pytest.mark.parametrize("route", sorted(HEADS))
async def test_a_million_one_byte_chunks_are_refused_early(gateway_factory: MakeSettings, route: str) -> None:
    """A body of a million one-byte chunks (6 MB on the wire for 1 MB of data, under the 16 MiB
    body limit), sent by four clients at once: each gets 413 in JSON once it passes the chunk
    bound (``max_chunks``: one per KiB of the body limit) and is closed (a route that reads no
    body answers first, then closes), and another client's /healthz is answered meanwhile within
    0.5 s. Before the bound each chunk cost the event loop about a microsecond of parser
    callbacks: the whole body was read (0.9 s of the loop per client, /healthz held 1 s behind
    four of them) and answered 400 bad_image."""
    settings = gateway_factory(backend="fake")
    request = HEADS[route] + CHUNKED + b"\r\n" + b"1\r\nx\r\n" * 1_000_000 + b"0\r\n\r\n"
    async with running_gateway(settings, FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None

        async def attack() -> tuple[int, dict[str, str], bytes, int]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await _send_until_answered(writer, reader, request)
            finally:
                writer.close()

        attacks = [asyncio.ensure_future(attack()) for _ in range(4)]
        worst = 0.0
        while not all(a.done() for a in attacks):
            worst = max(worst, await _served_meanwhile(port))
        for status, headers, body, _ in [a.result() for a in attacks]:
            _check_refusal(route, (status, headers, body), 413, "payload_too_large")
        assert worst < 0.5


async def test_a_body_just_within_the_chunk_bound_is_served(gateway_factory: MakeSettings) -> None:
    """An image in exactly ``max_chunks`` chunks, the last empty one included, each with a chunk
    extension, then trailers: served (the bound refuses only what passes it)."""
    settings = gateway_factory(backend="fake", max_body_bytes=64 * 1024)
    limit = max_chunks(settings.max_body_bytes)
    cuts = [len(PNG) * i // (limit - 1) for i in range(limit)]
    pieces = [PNG[start:end] for start, end in itertools.pairwise(cuts)]
    assert len(pieces) == limit - 1
    assert all(pieces)
    body = b"".join(b'%x;name=value;q="quoted"\r\n%s\r\n' % (len(p), p) for p in pieces)
    async with running_gateway(settings, FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEADS["classify"] + CHUNKED + b"\r\n" + body + b"0\r\nx-trailer: t\r\n\r\n")
        status, _, answer = await _answer(reader)
        assert status == 200, answer
        writer.write(HEADS["classify"] + CHUNKED + b"\r\n" + body + b"1\r\n\x00\r\n" + b"0\r\n\r\n")
        status, headers, answer = await _answer(reader)
        assert (status, _error_of(headers, answer)) == (413, "payload_too_large")
        writer.close()


@pytest.mark.parametrize("route", sorted(HEADS))
@pytest.mark.parametrize(
    ("framing", "status", "error"),
    [
        (CHUNKED + b"\r\n" + b"1" * 40 + b"\r\n", 400, "bad_request"),  # a chunk size that overflows 64 bits
        (CHUNKED + b"\r\n" + b"f" * 17 + b"\r\n", 400, "bad_request"),
        (CHUNKED + b"\r\n-1\r\n", 400, "bad_request"),
        (CHUNKED + b"\r\n0x10\r\n", 400, "bad_request"),
        (CHUNKED + b"content-length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400, "bad_request"),
        (b"content-length: 5\r\n" + CHUNKED + b"\r\n5\r\nhello\r\n0\r\n\r\n", 400, "bad_request"),
        (b"transfer-encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400, "bad_request"),
    ],
    ids=[
        "overflow-decimal-digits",
        "overflow-hex",
        "negative",
        "0x-prefix",
        "te-then-cl",
        "cl-then-te",
        "chunked-not-last",
    ],
)
async def test_malformed_chunk_framing_gets_a_json_400(
    gateway_factory: MakeSettings, route: str, framing: bytes, status: int, error: str
) -> None:
    """Chunk sizes that overflow, are negative or prefixed, a chunked body with Content-Length (in
    either order: request smuggling's classic), a transfer coding other than chunked: 400 in the
    gateway's JSON error shape, and the connection is closed."""
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEADS[route] + framing)
        _check_refusal(route, await _answer(reader), status, error)
        async with asyncio.timeout(ANSWER_WITHIN):
            assert await reader.read() == b""  # closed
        await _served_meanwhile(port)


@pytest.mark.parametrize("route", sorted(HEADS))
async def test_a_chunk_size_line_that_never_ends_is_cut_off(gateway_factory: MakeSettings, route: str) -> None:
    """A chunk extension trickled 4 KiB at a time with no end, well within the body clock: 400 in
    JSON (or the answer of a route that reads no body) and close before 2 x MAX_HEAD_BYTES are
    sent (llhttp skips extensions without bound: the gateway took them in for as long as the body
    clock ran)."""
    settings = gateway_factory(backend="fake", body_timeout=30.0)
    async with running_gateway(settings, FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        everything = asyncio.ensure_future(reader.read())  # until the gateway closes
        writer.write(HEADS[route] + CHUNKED + b"\r\n5\r\nhello\r\n1;ext=")
        sent = 0
        while not everything.done() and sent < 2 * MAX_HEAD_BYTES:
            writer.write(b"a" * 4096)
            sent += 4096
            await asyncio.sleep(0.005)
        async with asyncio.timeout(ANSWER_WITHIN):
            data = await everything
        answer = asyncio.StreamReader()
        answer.feed_data(data)
        _check_refusal(route, await _answer(answer), 400, "bad_request")
        assert sent < 2 * MAX_HEAD_BYTES


async def test_bodies_the_protocol_refuses_are_counted_as_refusals(gateway_factory: MakeSettings) -> None:
    """A body refused by the protocol (too many chunks: 413; an overflowing chunk size: 400) is
    counted under its route with the status it was answered and as a rejection by its reason, not
    as a client that left (499) or a failure (500)."""
    settings = gateway_factory(backend="fake", max_body_bytes=64 * 1024)
    async with running_gateway(settings, FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None
        for route, body in [
            ("classify", b"1\r\nx\r\n" * (max_chunks(settings.max_body_bytes) + 1)),
            ("v2-infer", b"5\r\nhello\r\n" + b"f" * 17 + b"\r\n"),
        ]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEADS[route] + CHUNKED + b"\r\n" + body)
            await _answer(reader)
            writer.close()
        async with asyncio.timeout(ANSWER_WITHIN):
            while 'reason="bad_request"} 1.0' not in (metrics := (await client.get("/metrics")).text):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    assert 'gateway_rejections_total{reason="payload_too_large"} 1.0' in metrics
    assert 'route="/classify",status="413"} 1.0' in metrics
    assert 'route="/v2/models/{name}/infer",status="400"} 1.0' in metrics
    assert 'status="499"' not in metrics
    assert 'status="500"' not in metrics


V2_BODY = json.dumps(
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(PNG).decode()]}]}
).encode()
BODIES = {"classify": PNG, "v2-infer": V2_BODY, "job-status": b""}
FUZZ_TIMEOUT = 0.3
"""The fuzzed gateway's header and body clocks: an incomplete request is answered 408 after it."""


@contextmanager
def _gateway_in_thread(settings: Settings) -> Iterator[int]:
    """A real gateway (fake backend) served by its own event loop in a thread; yields its port."""
    ready: queue.Queue[int] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        async with running_gateway(settings, FakeBackend()) as client:
            assert client.base_url.port is not None
            ready.put(client.base_url.port)
            while not stop.is_set():  # noqa: ASYNC110 (another thread's event)
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    try:
        yield ready.get(timeout=60)
    finally:
        stop.set()
        thread.join(timeout=60)


def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection and read until one whole response has come (or the
    gateway closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(OSError):  # it may answer and close before reading it all
            sock.sendall(request)
        data = b""
        with contextlib.suppress(OSError):
            while (chunk := sock.recv(65536)) and not _whole(data := data + chunk):
                pass
    return data


def _whole(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    return length is not None and len(body) >= int(length.group(1))


@st.composite
def _chunked(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` as chunks of drawn sizes, each size line written in a drawn way (case, leading
    zeros, spaces, extensions, sometimes overflowing), then the last chunk and drawn trailers."""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=12)))
    pieces = [body[a:b] for a, b in itertools.pairwise([0, *cuts, len(body)]) if b > a]
    out = b""
    for piece in [*pieces, b""]:
        size = f"{len(piece):x}".encode()
        size = draw(st.sampled_from([size, size.upper(), b"0" * draw(st.integers(1, 30)) + size]))
        if draw(st.integers(0, 29)) == 0:  # now and then, a size that is not one
            size = draw(st.sampled_from([b"f" * 17, b"1" * 40, b"-1", b"0x" + size, b"", b"g", size + b" "]))
        extension = draw(st.sampled_from([b"", b"", b"", b";a", b";a=b", b';a="q;\\"x"', b";" + b"e" * 300]))
        if draw(st.integers(0, 29)) == 0:  # now and then, one that is not one, or over the bound
            extension = draw(st.sampled_from([b"; a = b", b";\x00", b";" + b"e" * (MAX_HEAD_BYTES + 1)]))
        out += size + extension + b"\r\n" + (piece + b"\r\n" if piece else b"")
    trailers = draw(
        st.sampled_from(
            [b"", b"x-t: 1\r\n", b"content-length: 0\r\n", b"bad trailer\r\n", b"x: " + b"v" * 500 + b"\r\n"]
        )
    )
    return out + trailers + b"\r\n"


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """A request to one of the routes: its body framed by Content-Length, chunked, both or
    neither, drawn at the byte level, then maybe a few bytes inserted, deleted or replaced."""
    route = draw(st.sampled_from(sorted(HEADS)))
    body = BODIES[route] if draw(st.booleans()) else draw(st.binary(max_size=64))
    framing = draw(st.sampled_from(["length", "chunked", "chunked", "chunked", "both", "none", "te-variant"]))
    head = HEADS[route]
    if framing in ("length", "both"):
        length = str(len(body))
        if draw(st.integers(0, 3)) == 0:
            length = draw(
                st.sampled_from([str(len(body) + 1), "-1", "1" * 30, "0x10", f" {length}", f"{length},{length}"])
            )
        head += f"content-length: {length}\r\n".encode()
    if framing in ("chunked", "both"):
        head += CHUNKED
    if framing == "te-variant":
        head += draw(
            st.sampled_from(
                [
                    b"transfer-encoding: chunked, chunked\r\n",
                    b"transfer-encoding: identity\r\n",
                    b"transfer-encoding:  CHUNKED\r\n",
                    b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
                ]
            )
        )
    payload = draw(_chunked(body)) if framing in ("chunked", "both", "te-variant") else body
    request = bytearray(head + b"\r\n" + payload)
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 0, 1, 2, 3]))):
        at = draw(st.integers(0, len(request)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(st.sampled_from([b"\r", b"\n", b"\r\n", b"\x00", b";", b" ", b"0", b"f", b"\xff"]))
        if op == "insert":
            request[at:at] = piece
        elif op == "delete":
            del request[at : at + len(piece)]
        else:
            request[at : at + len(piece)] = piece
    return bytes(request)


def test_generated_requests_are_answered_in_json_never_500(gateway_factory: MakeSettings) -> None:
    """Requests generated at the byte level (``_requests``: framing, chunk sizes, extensions,
    trailers, stray bytes) on raw sockets to one real gateway: each gets an answer within the
    gateway's clocks, never a 5xx; every refusal is the gateway's JSON error; and after each one
    another client's /healthz is answered."""
    settings = gateway_factory(backend="fake", header_timeout=FUZZ_TIMEOUT, body_timeout=FUZZ_TIMEOUT)
    with _gateway_in_thread(settings) as port:

        @hypothesis_settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_requests())
        def check(request: bytes) -> None:
            started = time.perf_counter()
            answer = _exchange(port, request)
            assert time.perf_counter() - started < 5 * FUZZ_TIMEOUT + 2, request
            assert _whole(answer), (request, answer)
            head, _, body = answer.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            assert status < 500, (request, answer)
            if status >= 400:
                assert b"content-type: application/json" in head.lower(), (request, answer)
                assert json.loads(body)["error"], (request, answer)
            assert _whole(_exchange(port, HEALTHZ))

        check()
