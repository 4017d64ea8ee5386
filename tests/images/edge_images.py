"""Images at the edges of geometry, built in the test: 1x1, 1xN and Nx1, a side as long as each
format's decoder takes and one past it (1x65535 for JPEG), in PNG, JPEG and WebP, with an EXIF
orientation tag (1-8). Sides over what an encoder writes (libjpeg: 65,500; WebP: 16,383) are
written into the header of a small image of the same format, as a hostile client would."""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image

from service.images.preprocess import DECODER_MAX_SIDE

FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
"""Format (``ImageInfo.format``) to Pillow's name."""
MODES = {"jpeg": ("RGB", "L"), "png": ("RGB", "L", "RGBA", "I;16"), "webp": ("RGB", "RGBA")}
"""Pillow modes each format is built in: each takes another way through ``prepare``."""
ENCODER_MAX_SIDE = {"jpeg": 65_500, "png": 1_000_001, "webp": 16_383}


def geometries(fmt: str) -> list[tuple[int, int]]:
    """(width, height): one pixel, a row, a column, 1x65535 and 65535x1, and the longest side the
    format's decoder takes and one past it, each way."""
    top = DECODER_MAX_SIDE[fmt]
    sides = sorted({65_535, top, top + 1})
    return [(1, 1), (1, 300), (300, 1), *((1, s) for s in sides), *((s, 1) for s in sides)]


def refused(fmt: str, width: int, height: int) -> bool:
    """Whether the gateway must refuse this geometry (400): a side over what its decoder takes."""
    return max(width, height) > DECODER_MAX_SIDE[fmt]


def edge_image(fmt: str, width: int, height: int, orientation: int = 1, mode: str = "RGB") -> bytes:
    """An image of ``width`` x ``height`` (a gradient) tagged with an EXIF ``orientation``."""
    cap = ENCODER_MAX_SIDE[fmt]
    drawn_w, drawn_h = (width, height) if max(width, height) <= cap else (min(width, 16), min(height, 16))
    image = _drawn(drawn_w, drawn_h, mode)
    exif = image.getexif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, FORMATS[fmt], exif=exif.tobytes(), **({"lossless": True} if fmt == "webp" else {}))
    data = buffer.getvalue()
    if (drawn_w, drawn_h) == (width, height):
        return data
    return _jpeg_sized(data, width, height) if fmt == "jpeg" else _webp_sized(data, width, height)


def _drawn(width: int, height: int, mode: str) -> Image.Image:
    ramp = (np.arange(width * height, dtype=np.uint32) * 37 % 251).astype(np.uint8).reshape(height, width)
    rgb = np.stack([ramp, 255 - ramp, ramp // 2], axis=-1)
    if mode == "I;16":
        return Image.fromarray(ramp.astype(np.uint16) * 257)
    return Image.fromarray(rgb).convert(mode)


def _jpeg_sized(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a JPEG) with its frame header saying ``width`` x ``height``."""
    pos = 2
    while data[pos + 1] not in (0xC0, 0xC1, 0xC2):
        pos += 2 + struct.unpack_from(">H", data, pos + 2)[0]
    return data[: pos + 5] + struct.pack(">HH", height, width) + data[pos + 9 :]


def _webp_sized(data: bytes, width: int, height: int) -> bytes:
    """``data`` (an extended WebP: its EXIF makes it one) with its canvas saying ``width`` x ``height``."""
    assert data[12:16] == b"VP8X"
    return data[:24] + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little") + data[30:]


def header_sized(fmt: str, width: int, height: int) -> bytes:
    """A small BMP, TIFF, PNG or JPEG whose header says ``width`` x ``height``, as a hostile client
    would write it (for sides and pixel counts past what OpenCV's ``imdecode`` takes in any format)."""
    if fmt == "jpeg":
        return _jpeg_sized(edge_image("jpeg", 16, 16), width, height)
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((1, 1, 3), np.uint8)).save(buffer, fmt.upper())
    data = bytearray(buffer.getvalue())
    if fmt == "bmp":
        struct.pack_into("<ii", data, 18, width, height)
    elif fmt == "png":
        struct.pack_into(">II", data, 16, width, height)  # the IHDR's CRC is not checked by the probe
    else:
        (ifd,) = struct.unpack_from("<I", data, 4)
        for entry in range(ifd + 2, ifd + 2 + 12 * struct.unpack_from("<H", data, ifd)[0], 12):
            tag = struct.unpack_from("<H", data, entry)[0]
            if tag in (256, 257):  # ImageWidth, ImageLength, as LONGs
                struct.pack_into("<HHII", data, entry, tag, 4, 1, width if tag == 256 else height)
    return bytes(data)
