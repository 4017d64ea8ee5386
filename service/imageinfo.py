"""Image format, dimensions and EXIF orientation, read from the first bytes without decoding.

Knowing the pixel count before decoding is what stops a decompression bomb (a small file that
claims 50,000 x 50,000 pixels); the same cheap check validates images in offline mode.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from service.errors import BadImage

FORMATS = ("jpeg", "png", "gif", "webp", "bmp", "tiff")
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int
    height: int
    orientation: int = 1
    """EXIF orientation, 1 (upright) to 8."""

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _tiff_tags(data: bytes, wanted: set[int]) -> dict[int, int]:
    """Integer values of the wanted tags in the first IFD of a TIFF structure (also EXIF's)."""
    if len(data) < 8 or data[:2] not in (b"II", b"MM"):
        return {}
    endian = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(endian + "I", data, 4)
    if ifd + 2 > len(data):
        return {}
    (count,) = struct.unpack_from(endian + "H", data, ifd)
    found: dict[int, int] = {}
    for i in range(min(count, 512)):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(data):
            break
        tag, typ = struct.unpack_from(endian + "HH", data, entry)
        if tag in wanted:
            if typ == 3:  # SHORT
                (found[tag],) = struct.unpack_from(endian + "H", data, entry + 8)
            elif typ == 4:  # LONG
                (found[tag],) = struct.unpack_from(endian + "I", data, entry + 8)
    return found


def _jpeg(data: bytes) -> ImageInfo:
    pos, orientation = 2, 1
    n = len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            raise BadImage("corrupt JPEG: expected a marker")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", data, pos + 2)
        segment = data[pos + 4 : pos + 2 + length]
        if marker == 0xE1 and segment.startswith(b"Exif\x00\x00"):
            orientation = _tiff_tags(segment[6:], {_ORIENTATION_TAG}).get(_ORIENTATION_TAG, 1)
        elif marker in _JPEG_SOF and len(segment) >= 5:
            height, width = struct.unpack_from(">HH", segment, 1)
            return ImageInfo("jpeg", width, height, orientation if 1 <= orientation <= 8 else 1)
        elif marker == 0xDA:
            break
        pos += 2 + length
    raise BadImage("corrupt JPEG: no frame header found")


def _webp(data: bytes) -> ImageInfo:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        w, h = struct.unpack_from("<HH", data, 26)
        return ImageInfo("webp", w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25:
        (bits,) = struct.unpack_from("<I", data, 21)
        return ImageInfo("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X" and len(data) >= 30:
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return ImageInfo("webp", w, h)
    raise BadImage("corrupt WebP header")


def probe(data: bytes) -> ImageInfo:
    """Identify the image; raise BadImage for empty, truncated or unrecognised bytes."""
    if not data:
        raise BadImage("empty image")
    try:
        if data.startswith(b"\xff\xd8\xff"):
            return _jpeg(data)
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            if data[12:16] != b"IHDR":
                raise BadImage("corrupt PNG: no IHDR chunk")
            w, h = struct.unpack_from(">II", data, 16)
            return ImageInfo("png", w, h)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack_from("<HH", data, 6)
            return ImageInfo("gif", w, h)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
        if data[:2] == b"BM":
            (dib,) = struct.unpack_from("<I", data, 14)
            if dib == 12:
                w, h = struct.unpack_from("<HH", data, 18)
            else:
                w, h = struct.unpack_from("<ii", data, 18)
            return ImageInfo("bmp", abs(w), abs(h))
        if data[:4] in (b"II*\x00", b"MM\x00*"):
            tags = _tiff_tags(data, {256, 257, _ORIENTATION_TAG})
            if 256 not in tags or 257 not in tags:
                raise BadImage("corrupt TIFF: no dimensions in the first IFD")
            orientation = tags.get(_ORIENTATION_TAG, 1)
            return ImageInfo("tiff", tags[256], tags[257], orientation if 1 <= orientation <= 8 else 1)
    except struct.error:
        raise BadImage("truncated image header") from None
    raise BadImage("not a recognised image (JPEG, PNG, GIF, WebP, BMP or TIFF expected)")
