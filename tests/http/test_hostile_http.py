"""Hostile bytes on the HTTP connection, sent on raw sockets to a real uvicorn running the gateway's
protocol (``service.http.protocol``): stray CR and LF between requests, partial request lines,
pipelined requests, requests split at every byte. Every connection must always have a clock."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from service.backends.fake import FakeBackend
from service.http.protocol import MAX_HEAD_BYTES, MAX_HEADERS
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
PNG = png_bytes(solid_image(7, 32))
CLASSIFY = b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n" + (
    f"content-length: {len(PNG)}\r\n\r\n".encode() + PNG
)
HEADER_TIMEOUT = 0.5
"""Far below uvicorn's keep-alive timeout (5 s), so a close within it is the header clock's."""
ENDS_WITHIN = 4.0
"""How long a test waits for the server to end a connection it must end after HEADER_TIMEOUT."""

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """One whole response (head and Content-Length body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection; fails if it keeps it open."""
    async with asyncio.timeout(ENDS_WITHIN):
        return await reader.read()


@asynccontextmanager
async def _gateway(
    settings: Settings, backend: FakeBackend | None = None
) -> AsyncIterator[Callable[..., asyncio.Future[Connection]]]:
    """A running gateway, and a way to open raw connections to it (closed at the end): from a new
    socket, or from a given unconnected one."""
    writers: list[asyncio.StreamWriter] = []
    async with running_gateway(settings, backend or FakeBackend()) as client:
        port = client.base_url.port
        assert port is not None

        async def connect(sock: socket.socket | None = None) -> Connection:
            if sock is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            else:
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                reader, writer = await asyncio.open_connection(sock=sock)
            writers.append(writer)
            return reader, writer

        try:
            yield lambda sock=None: asyncio.ensure_future(connect(sock))
        finally:
            for writer in writers:
                writer.close()


@pytest.mark.parametrize("stray", [b"\r\n", b"\n", b"\r", b"\r\n\r\n\r\n"], ids=["crlf", "lf", "cr", "crlfs"])
async def test_stray_line_ends_after_a_response_are_timed_out(gateway_factory: MakeSettings, stray: bytes) -> None:
    """After a response, bytes that begin no request (llhttp skips CR and LF between messages) and
    then silence: the connection gets 408 and is closed within the header timeout, not held for ever."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.write(stray)
        answer = await _until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 408")
        assert b'"request_timeout"' in answer


async def test_trickled_line_ends_do_not_restart_the_clock(gateway_factory: MakeSettings) -> None:
    """A CRLF every 0.2 s after a response, for longer than the header timeout: the first one starts
    the clock and later ones do not restart it; the connection is cut off."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")

        async def trickle() -> None:
            while not writer.is_closing():
                writer.write(b"\r\n")
                await asyncio.sleep(0.2)

        sender = asyncio.create_task(trickle())
        try:
            assert (await _until_closed(reader)).startswith(b"HTTP/1.1 408")
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


@pytest.mark.parametrize("partial", [b"G", b"GET /healthz HT", b"\r\nGET /healthz HTTP/1.1\r\nhost: x\r\n"])
async def test_a_partial_next_request_is_timed_out(gateway_factory: MakeSettings, partial: bytes) -> None:
    """After a response, the start of a next request (after stray line ends or not) and then silence:
    408 and close within the header timeout."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.write(partial)
        assert (await _until_closed(reader)).startswith(b"HTTP/1.1 408")


async def test_stray_bytes_before_the_first_request_are_timed_out(gateway_factory: MakeSettings) -> None:
    """A new connection that sends only CRLFs: 408 and close within the header timeout."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(b"\r\n\r\n")
        assert (await _until_closed(reader)).startswith(b"HTTP/1.1 408")


async def test_line_end_holders_cannot_lock_out_other_clients(gateway_factory: MakeSettings) -> None:
    """max_connections - 1 clients that each answer a response with a CRLF and then nothing: while
    they are connected others get 503, but their connections are ended within the header timeout
    and then another client is served."""
    settings = gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT, max_connections=4)
    async with _gateway(settings) as connect:
        holders = [await connect() for _ in range(settings.max_connections - 1)]
        for reader, writer in holders:
            writer.write(HEALTHZ)
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            writer.write(b"\r\n")
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 503")  # locked out while they hold on
        await asyncio.gather(*(_until_closed(holder) for holder, _ in holders))
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")


async def test_a_request_split_at_every_byte_is_served(gateway_factory: MakeSettings) -> None:
    """A request sent one byte per write, with stray CRLFs before it, within the header timeout: it
    is served, and the connection stays usable."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=5.0)) as connect:
        reader, writer = await connect()
        for byte in b"\r\n" + CLASSIFY:
            writer.write(bytes([byte]))
            await writer.drain()
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")


async def test_pipelined_requests_behind_a_slow_one_are_not_timed_out(gateway_factory: MakeSettings) -> None:
    """Pipelined requests, the last one's head cut in two and its rest sent only after the header
    timeout, behind a request answered even later: while an earlier answer is being made the
    waiting request is not cut off (its bytes may sit unread: uvicorn pauses reading behind a
    pipelined request), and no 408 jumps ahead; every request is answered, in order."""
    backend, held = _held_backend()
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT), backend) as connect:
        reader, writer = await connect()
        cut = len(HEALTHZ) // 2
        writer.write(CLASSIFY + HEALTHZ + HEALTHZ[:cut])
        await backend.wait_for_batches(1)
        await asyncio.sleep(2 * HEADER_TIMEOUT)  # past the last request's header timeout
        writer.write(HEALTHZ[cut:])
        held.set()
        answers = [await _answer(reader) for _ in range(3)]
        assert [a.split(b" ", 2)[1] for a in answers] == [b"200", b"200", b"200"]
        assert b'"results"' in answers[0]


async def test_a_stalled_pipelined_request_waits_for_the_earlier_answer(gateway_factory: MakeSettings) -> None:
    """A request answered later than the header timeout, with half of a next request pipelined
    behind it and then silence: the first request's answer comes whole, then the 408, then close."""
    backend, held = _held_backend()
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT), backend) as connect:
        reader, writer = await connect()
        writer.write(CLASSIFY + HEALTHZ[:10])
        await backend.wait_for_batches(1)
        await asyncio.sleep(2 * HEADER_TIMEOUT)  # the answer comes after the next request's header timeout
        held.set()
        assert b'"results"' in await _answer(reader)
        assert (await _until_closed(reader)).startswith(b"HTTP/1.1 408")


def _held_backend() -> tuple[FakeBackend, asyncio.Event]:
    """A fake backend whose batches wait for the returned event."""
    backend = FakeBackend()
    backend.gate = asyncio.Event()
    return backend, backend.gate


async def test_an_unsupported_upgrade_then_a_stray_byte_is_timed_out(gateway_factory: MakeSettings) -> None:
    """A request asking to upgrade to a protocol the server does not speak is served as plain HTTP;
    a line end after it and then silence is timed out like any other."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.write(b"\r\n")
        assert (await _until_closed(reader)).startswith(b"HTTP/1.1 408")


async def test_a_websocket_upgrade_is_refused_and_closed(gateway_factory: MakeSettings) -> None:
    """A WebSocket upgrade (the gateway has no WebSocket route) is handed to uvicorn's WebSocket
    protocol, refused, and the connection closed: the HTTP protocol's clock does not write into it."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=HEADER_TIMEOUT)) as connect:
        reader, writer = await connect()
        writer.write(
            b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        answer = await _until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 403")
        assert b"408" not in answer


async def test_a_client_that_never_reads_its_answers_is_dropped(gateway_factory: MakeSettings) -> None:
    """Hundreds of pipelined GET /metrics (19 KB answers each) on a socket with a small receive
    buffer, never read: the gateway's writes back up, and after the body timeout the connection is
    dropped, so such clients cannot hold max_connections - 1 connections for ever."""
    settings = gateway_factory(
        backend="fake", header_timeout=HEADER_TIMEOUT, body_timeout=HEADER_TIMEOUT, max_connections=2
    )
    async with _gateway(settings) as connect:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connecting: a small window
        _, hoarder = await connect(sock)
        hoarder.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 600)  # ~11 MB of answers
        async with asyncio.timeout(ENDS_WITHIN):
            while True:  # poll: served once the hoarder's connection is gone (503 while it holds on)
                reader, writer = await connect()
                writer.write(HEALTHZ)
                answer = await _answer(reader)
                writer.close()
                if answer.startswith(b"HTTP/1.1 200"):
                    break
                await asyncio.sleep(0.1)
        hoarder.close()


ESTABLISHED = 1


def _server_socket(server_port: int, client_port: int) -> tuple[int, int]:
    """The state of the server's socket of a connection (/proc/net/tcp: 1 established; after the
    server lets go of it, FIN_WAIT1 and on, or gone) and the bytes its kernel holds unsent."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        if (int(local, 16), int(remote, 16)) == (server_port, client_port):
            return int(fields[3], 16), int(fields[4].split(":")[0], 16)
    return 0, 0


async def test_a_client_that_stops_reading_with_little_pending_is_dropped(gateway_factory: MakeSettings) -> None:
    """A client on a small window sends one GET /metrics at a time until the server's kernel buffer
    is full, so that less than one answer waits in the gateway (far under the 64 KiB at which
    writes used to pause), then goes silent. Closing such a connection (keep-alive) waits for the
    pending bytes to leave, which never happens: it held its place for ever. It must be dropped."""
    settings = gateway_factory(
        backend="fake", header_timeout=HEADER_TIMEOUT, body_timeout=HEADER_TIMEOUT, max_connections=2
    )
    async with _gateway(settings) as connect:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        _, hoarder = await connect(sock)
        server_port, client_port = sock.getpeername()[1], sock.getsockname()[1]
        queued = -1
        for _ in range(400):  # until an answer no longer fits in the kernel's buffer
            hoarder.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            await asyncio.sleep(0.05)
            state, now = _server_socket(server_port, client_port)
            if state != ESTABLISHED or 0 < now == queued:  # (the client's stream reader takes 128 KiB first)
                break
            queued = now
        assert queued > 0, "the server's send queue never filled"
        async with asyncio.timeout(5 + 2 * ENDS_WITHIN):  # keep-alive (5 s), then the body timeout
            while _server_socket(server_port, client_port)[0] == ESTABLISHED:  # noqa: ASYNC110 (the kernel's state: no event)
                await asyncio.sleep(0.1)
        reader, writer = await connect()
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        hoarder.close()


def _head_with(header: bytes = b"", url: bytes = b"/healthz") -> bytes:
    return b"GET " + url + b" HTTP/1.1\r\nhost: x\r\n" + header + b"\r\n"


@pytest.mark.parametrize(
    "head",
    [
        _head_with(b"x-big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\n"),
        _head_with(url=b"/healthz?" + b"a" * (MAX_HEAD_BYTES + 1)),
        _head_with(b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))),
    ],
    ids=["one-big-header", "big-url", "many-headers"],
)
async def test_a_head_over_the_bound_gets_431(gateway_factory: MakeSettings, head: bytes) -> None:
    """A request whose URL and headers are over MAX_HEAD_BYTES, or with more than MAX_HEADERS
    headers, sent whole: 431 in the gateway's JSON error shape, and the connection is closed (no
    bound at all before: such heads were served, and hundreds of MiB of header were taken in)."""
    async with _gateway(gateway_factory(backend="fake")) as connect:
        reader, writer = await connect()
        writer.write(head)
        answer = await _until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 431")
        assert b'"headers_too_large"' in answer


async def test_a_head_that_never_ends_is_cut_off_at_the_bound(gateway_factory: MakeSettings) -> None:
    """One header value trickled 4 KiB at a time with no end, well within the header clock (30 s):
    the connection gets 431 and is closed before 2 x MAX_HEAD_BYTES are sent, instead of the
    gateway taking in all it is given (the head's bytes are counted as they arrive)."""
    async with _gateway(gateway_factory(backend="fake", header_timeout=30.0)) as connect:
        reader, writer = await connect()
        answer = asyncio.ensure_future(_until_closed(reader))
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
        await _trickled_until_431(writer, answer)


async def _trickled_until_431(writer: asyncio.StreamWriter, answer: asyncio.Future[bytes]) -> None:
    """Send 4 KiB pieces of one never-ending field until the gateway answers: 431, before twice
    MAX_HEAD_BYTES were sent."""
    sent = 0
    while not answer.done() and sent < 2 * MAX_HEAD_BYTES:
        writer.write(b"a" * 4096)
        sent += 4096
        await asyncio.sleep(0.005)  # a trickle: the gateway reads each piece as it comes
    assert (await answer).startswith(b"HTTP/1.1 431")
    assert sent < 2 * MAX_HEAD_BYTES


CHUNKED = b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_trailers_that_never_end_are_cut_off_at_the_bound(gateway_factory: MakeSettings) -> None:
    """A chunked body, its last chunk, then one trailer field trickled 4 KiB at a time with no end,
    well within the body clock (30 s): 431 and close before 2 x MAX_HEAD_BYTES are sent (llhttp and
    httptools took trailers in without bound: 20 MB of them cost +206 MiB of a gateway's memory)."""
    settings = gateway_factory(backend="fake", header_timeout=30.0, body_timeout=30.0)
    async with _gateway(settings) as connect:
        reader, writer = await connect()
        answer = asyncio.ensure_future(_until_closed(reader))
        writer.write(CHUNKED + f"{len(PNG):x}\r\n".encode() + PNG + b"\r\n0\r\nx-trailer: ")
        await _trickled_until_431(writer, answer)


async def test_a_chunked_body_trickled_with_trailers_is_served(gateway_factory: MakeSettings) -> None:
    """A chunked body of one-byte chunks, each sent on its own with its size line apart from its
    data, then a small trailer: served, and the connection stays usable (the chunks' framing is not
    counted as trailers)."""
    async with _gateway(gateway_factory(backend="fake", body_timeout=30.0)) as connect:
        reader, writer = await connect()
        writer.write(CHUNKED)
        for byte in PNG:
            for piece in (b"1\r\n", bytes([byte]) + b"\r\n"):
                writer.write(piece)
                await writer.drain()
        writer.write(b"0\r\nx-trailer: " + b"a" * 1000 + b"\r\n\r\n")
        assert b'"results"' in await _answer(reader)
        writer.write(HEALTHZ)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("split", [False, True], ids=["whole", "byte-reads"])
async def test_a_head_just_under_the_bound_is_served(gateway_factory: MakeSettings, split: bool) -> None:
    """A request whose URL and headers are just under MAX_HEAD_BYTES, in one write or trickled in
    1 KiB reads after a pipelined request with a body: it is served (the bound counts the head's own
    bytes, not what came before it in the same read)."""
    head = _head_with(b"x-big: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n")
    async with _gateway(gateway_factory(backend="fake", header_timeout=30.0)) as connect:
        reader, writer = await connect()
        data = CLASSIFY + head
        if split:
            for start in range(0, len(data), 1024):
                writer.write(data[start : start + 1024])
                await writer.drain()
        else:
            writer.write(data)
        assert b'"results"' in await _answer(reader)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "data",
    [
        bytes.fromhex("160301020001") + b"\x00" * 64,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET / HTTP/1.1\r\n\x00\r\n\r\n",
    ],
    ids=["tls-client-hello", "http2-preface", "nul-in-head"],
)
async def test_bytes_that_are_not_http_get_a_json_400(gateway_factory: MakeSettings, data: bytes) -> None:
    """TLS on the plaintext port, an HTTP/2 preface, a NUL byte in a head: 400 in the gateway's
    JSON error shape (uvicorn's own answer was text/plain), then the connection is closed."""
    async with _gateway(gateway_factory(backend="fake")) as connect:
        reader, writer = await connect()
        writer.write(data)
        answer = await _until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 400")
        assert b"content-type: application/json" in answer
        assert b'"bad_request"' in answer
