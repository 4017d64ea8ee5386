"""The TIFF header as libtiff reads it: the probe's width, height, samples and bits are the ones the
decoder then decodes, so the memory budget checked on them holds (a TIFF whose probe and decoder
disagree passes the budget as a small image and decodes as a large one)."""

from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np
import pytest

from service.errors import BadImage, PayloadTooLarge
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, prepare

WIDTH, HEIGHT, BITS, COMPRESSION, PHOTOMETRIC = 256, 257, 258, 259, 262
STRIP_OFFSETS, SAMPLES, ROWS_PER_STRIP, STRIP_BYTES = 273, 277, 278, 279
TYPES = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i"}
"""TIFF integer types (BYTE, SHORT, LONG, SBYTE, SSHORT, SLONG) to struct formats."""


def tiff(width: int, height: int, *, size_type: int = 4, then: list[tuple[int, int, int]] | None = None) -> bytes:
    """A deflated 8-bit grey TIFF of ``width`` x ``height`` zeros (small whatever its size), its
    ImageWidth and ImageLength of TIFF type ``size_type``; ``then``: entries (tag, type, value)
    after the usual ones, e.g. a tag given a second time."""
    compressor = zlib.compressobj(9)
    row = bytes(width)
    strip = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    entries = [
        (WIDTH, size_type, width),
        (HEIGHT, size_type, height),
        (BITS, 3, 8),
        (COMPRESSION, 3, 8),
        (PHOTOMETRIC, 3, 1),
        (STRIP_OFFSETS, 4, 0),
        (SAMPLES, 3, 1),
        (ROWS_PER_STRIP, 4, height),
        (STRIP_BYTES, 4, len(strip)),
        *(then or []),
    ]
    start = 8 + 2 + 12 * len(entries) + 4
    out = b"II*\x00" + struct.pack("<IH", 8, len(entries))
    for tag, kind, value in entries:
        value = start if tag == STRIP_OFFSETS else value
        out += struct.pack("<HHI", tag, kind, 1) + struct.pack("<" + TYPES[kind], value).ljust(4, b"\x00")
    return out + b"\x00" * 4 + strip


def decoded_shape(data: bytes) -> tuple[int, ...] | None:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    return None if image is None else image.shape


def test_a_size_given_twice_is_its_first_entry_as_libtiff_reads_it() -> None:
    """ImageWidth and ImageLength given twice, 20,000 then 1: libtiff ignores the later entries and
    decodes 20,000 x 20,000 (400 MB of pixels from a 390 KB file); the probe reads the same and the
    budget refuses it (413 naming the size). The probe took the last entries: 1x1, under every
    bound, and the decode took 820 MB and 2 s."""
    bomb = tiff(20_000, 20_000, then=[(WIDTH, 4, 1), (HEIGHT, 4, 1)])
    assert len(bomb) < 400_000
    info = probe(bomb)
    assert (info.width, info.height) == (20_000, 20_000)
    with pytest.raises(PayloadTooLarge, match="20000x20000"):
        prepare(bomb, PreprocessConfig())
    small = tiff(64, 48, then=[(WIDTH, 4, 1), (HEIGHT, 4, 1)])
    assert decoded_shape(small) == (48, 64)
    assert (probe(small).width, probe(small).height) == (64, 48)


@pytest.mark.parametrize("kind", sorted(TYPES), ids=lambda kind: TYPES[kind])
def test_a_size_of_any_integer_type_is_read_as_libtiff_reads_it(kind: int) -> None:
    """The width and height as BYTE, SHORT, LONG, SBYTE, SSHORT or SLONG: libtiff takes each, and
    so does the probe (it read SHORT and LONG only, and refused the others as without dimensions)."""
    data = tiff(100, 50, size_type=kind)
    assert decoded_shape(data) == (50, 100)
    assert (probe(data).width, probe(data).height) == (100, 50)


def test_samples_and_bits_given_as_bytes_count_in_the_budget() -> None:
    """SamplesPerPixel 4 and BitsPerSample 16 given as BYTE entries (first, before the usual SHORT
    ones, which libtiff then ignores): the probe reads 4 channels of 16 bits, as libtiff does, not
    the defaults (1 of 8), which under-counted the decoder's memory."""
    data = tiff(8, 8)
    entries_at = 10
    (count,) = struct.unpack_from("<H", data, 8)
    first = struct.pack("<HHIBxxx", SAMPLES, 1, 1, 4) + struct.pack("<HHIBxxx", BITS, 1, 1, 16)
    # the new entries go first (tags out of order: libtiff warns and reads on); the strip moves by 24
    body = bytearray(data[entries_at:])
    for i in range(count):
        tag, kind, n, value = struct.unpack_from("<HHII", body, 12 * i)
        if tag == STRIP_OFFSETS:
            struct.pack_into("<HHII", body, 12 * i, tag, kind, n, value + 24)
    moved = data[:8] + struct.pack("<H", count + 2) + first + bytes(body)
    info = probe(moved)
    assert (info.channels, info.bits, info.alpha) == (4, 16, True)


def test_a_negative_size_is_no_size() -> None:
    """A width of -100 as an SSHORT: libtiff refuses it, and the probe finds no dimensions (400)."""
    data = tiff(100, 50, size_type=8)
    negative = data.replace(struct.pack("<HHIh", WIDTH, 8, 1, 100), struct.pack("<HHIh", WIDTH, 8, 1, -100))
    assert decoded_shape(negative) is None
    with pytest.raises(BadImage, match="no dimensions"):
        probe(negative)
