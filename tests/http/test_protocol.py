"""The gateway's HTTP protocol (``service.http.protocol``): responses written once per loop turn, and
request timers armed only while a request is still arriving, checked on a real uvicorn server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from service.backends.fake import FakeBackend
from service.http.transport import CoalescingTransport
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
PNG = png_bytes(solid_image(7, 32))
REQUEST = b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: image/png\r\n" + (
    f"content-length: {len(PNG)}\r\n\r\n".encode() + PNG
)


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


async def test_writes_of_one_turn_go_out_as_one_and_close_sends_them_first() -> None:
    """uvicorn writes a response's head and body separately: they leave in one write, in order, at
    the end of the turn; a close sends what is pending before closing."""
    recording = Recording()
    transport = CoalescingTransport(recording, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"body")
    assert recording.writes == []
    await asyncio.sleep(0)
    assert recording.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    transport.write(b"last")
    transport.close()
    assert recording.writes[-1] == b"last"
    assert recording.closed
    await asyncio.sleep(0)
    assert len(recording.writes) == 2  # nothing written twice by the flush scheduled before the close


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


async def test_pipelined_requests_are_each_answered_whole(gateway_factory: MakeSettings) -> None:
    """Two requests in one write on a keep-alive connection: two complete 200 answers, in order."""
    settings = gateway_factory(backend="fake", header_timeout=1.0)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(REQUEST + REQUEST)
        first, second = await _answer(reader), await _answer(reader)
        assert first.startswith(b"HTTP/1.1 200")
        assert second.startswith(b"HTTP/1.1 200")
        assert b'"results"' in first
        assert b'"results"' in second
        writer.close()


async def test_a_later_request_on_a_kept_connection_has_its_own_header_clock(gateway_factory: MakeSettings) -> None:
    """After a served request (no timer left armed), the next request's headers trickling in are cut
    off with 408 about GATEWAY_HEADER_TIMEOUT after its first byte, not sooner or never."""
    settings = gateway_factory(backend="fake", header_timeout=1.0)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(REQUEST)
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(1.5)  # idle longer than the header timeout: idle is uvicorn's keep-alive to bound
        started = time.monotonic()

        async def trickle() -> None:
            for byte in b"POST /classify HTTP/1.1\r\nhost: x\r\n":
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)

        sender = asyncio.create_task(trickle())
        try:
            async with asyncio.timeout(3):
                answer = await reader.read()
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        assert answer.startswith(b"HTTP/1.1 408")
        assert 0.9 <= time.monotonic() - started <= 2.5
        writer.close()


async def test_an_answer_of_the_protocols_own_goes_after_the_requests_answer_still_held() -> None:
    """A pipelined request's 408 (the protocol's own answer) made in the loop turn that completed
    the earlier request's answer: that answer, still held for the end of the turn, goes first and
    whole, and the 408 after it, then the close (the 408 went first and the answer was dropped)."""
    from service.errors import RequestTimeout
    from service.http.protocol import TimeoutProtocol

    recording = Recording()
    protocol = object.__new__(TimeoutProtocol)
    protocol.transport = recording
    held = CoalescingTransport(recording, asyncio.get_running_loop())
    protocol._task_writes = held
    held.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    held.write(b"done")
    protocol._answer(RequestTimeout("the request headers did not arrive within 0.5 s"))
    await asyncio.sleep(0)
    assert recording.writes[0] == b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone"
    assert recording.writes[1].startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert len(recording.writes) == 2
    assert recording.closed
