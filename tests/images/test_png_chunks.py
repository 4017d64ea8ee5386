"""A PNG's chunk lengths are checked against the file before OpenCV reads it: its reader allocates
(and zeroes) what a chunk says it holds before reading a byte of it."""

from __future__ import annotations

import io
import struct
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image

from service.backends.fake import FakeBackend
from service.errors import BadImage
from service.images.imageinfo import MAX_SEGMENTS, MIN_PNG_CHUNK, probe
from service.images.preprocess import PreprocessConfig, prepare
from service.settings import Settings
from tests.conftest import running_gateway

MakeSettings = Callable[..., Settings]


def png(width: int = 20, height: int = 20) -> bytes:
    """A PNG of noise (its image data does not compress away)."""
    buffer = io.BytesIO()
    pixels = np.random.default_rng(7).integers(0, 256, (height, width, 3), np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def lying(kind: bytes, length: int) -> bytes:
    """A 20x20 PNG whose ``kind`` chunk says ``length`` bytes (the file is about 1.3 KB)."""
    data = png()
    at = data.index(kind) - 4
    return data[:at] + struct.pack(">I", length) + data[at + 4 :]


@pytest.mark.parametrize("kind", [b"IDAT", b"IEND"])
def test_a_chunk_longer_than_the_file_is_refused_from_the_header(kind: bytes) -> None:
    """An IDAT (or IEND) that says 1 GiB in a file of 1.3 KB: the probe refuses it as truncated,
    naming the chunk, before OpenCV allocates the gigabyte (it took 1 GB and 0.8 s to find it
    truncated; four of 4 GB in one request ended the gateway)."""
    bomb = lying(kind, 1 << 30)
    started = time.perf_counter()
    with pytest.raises(BadImage, match=f"truncated PNG: its '{kind.decode()}' chunk says {1 << 30} bytes"):
        prepare(bomb, PreprocessConfig())
    assert time.perf_counter() - started < 0.2


def test_image_data_in_many_small_chunks_is_read() -> None:
    """Image data split in many IDAT chunks (encoders write 8-64 KiB each; here 300 bytes), with
    ancillary chunks between: within the bound, probed and prepared."""
    data = png(300, 200)
    start, end = data.index(b"IDAT") - 4, data.index(b"IEND") - 4
    stream = b""
    pos = start
    while pos < end:
        (length,) = struct.unpack_from(">I", data, pos)
        stream += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    pieces = [chunk(b"IDAT", stream[i : i + 300]) for i in range(0, len(stream), 300)]
    split = data[:start] + chunk(b"tEXt", b"a\x00b") + b"".join(pieces) + data[end:]
    assert len(pieces) > 3
    assert (probe(split).width, probe(split).height) == (300, 200)
    assert prepare(split, PreprocessConfig()).shape == (224, 224, 3)


def test_millions_of_empty_chunks_are_refused_in_milliseconds() -> None:
    """16 MB of empty tEXt chunks (1.3 million): refused once past one chunk per MIN_PNG_CHUNK
    bytes, in well under a second, not walked to the end."""
    head = png()[:33]
    data = head + chunk(b"tEXt", b"") * (16_000_000 // 12)
    started = time.perf_counter()
    with pytest.raises(BadImage, match=f"more than {MAX_SEGMENTS + len(data) // MIN_PNG_CHUNK} chunks"):
        probe(data)
    assert time.perf_counter() - started < 0.5


async def test_a_lying_png_through_classify_is_a_400(gateway_factory: MakeSettings) -> None:
    """Through a real gateway: four 1.3 KB PNGs whose IDAT says 4 GB each, in one request, are a
    400 ``bad_image`` naming the first (the decoders allocated 16 GB), and the gateway serves on."""
    bomb = lying(b"IDAT", 0xFF000000)
    files = [("file", (f"b{i}.png", bomb, "image/png")) for i in range(4)]
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        answer = await client.post("/classify", files=files)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == "bad_image"
        assert "truncated PNG: its 'IDAT' chunk says 4278190080 bytes" in answer.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200
