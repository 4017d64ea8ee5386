"""Image format, dimensions, sample layout and EXIF orientation, read from the header without decoding.

EXIF orientation comes from a JPEG's APP1 segment, a TIFF's first IFD, a PNG's ``eXIf`` chunk before
the image data and an extended WebP's ``EXIF`` chunk (OpenCV's decoders apply all four themselves;
the gateway decodes with orientation ignored and applies it after the crop).

What the header says (width x height x channels x bytes per sample, and for JPEG whether the decoder
must keep the whole image's DCT coefficients) is what lets the gateway refuse a decompression bomb
before decoding it, and the same cheap check validates images in offline mode.

The walk is bounded so that hostile bytes cost little: the JPEG marker walk reads at most
``HEADER_WINDOW`` bytes and ``MAX_SEGMENTS`` segments, refuses fill runs over ``MAX_FILL``, and
refuses files with more than ``MAX_SCANS`` scans (each progressive scan is another pass of the
decoder over the whole image). Pillow's lazy ``Image.open`` would give the same facts, but its JPEG
reader steps over junk one byte at a time in Python, so it is not bounded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from service.errors import BadImage

_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_JPEG_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xD8)})
"""JPEG markers without a length field (TEM, RSTn)."""
_ORIENTATION_TAG = 0x0112
_TIFF_WIDTH, _TIFF_HEIGHT, _TIFF_BITS, _TIFF_SAMPLES, _TIFF_EXTRA = 256, 257, 258, 277, 338
_TIFF_PHOTOMETRIC = 262
# PNG colour types: samples per pixel, and whether one of them is alpha (3, palette: 1 index)
_PNG_COLOUR = {0: (1, False), 2: (3, False), 3: (1, False), 4: (2, True), 6: (4, True)}

HEADER_WINDOW = 1024 * 1024
"""The JPEG frame header must start within this many bytes (real ones do within a few hundred KB,
EXIF thumbnails and ICC profiles included)."""
MAX_SEGMENTS = 512
"""JPEG segments allowed before the frame header (real files have a few dozen)."""
MAX_FILL = 64
"""Consecutive 0xFF fill bytes allowed before a JPEG marker."""
MAX_SCANS = 100
"""JPEG scans allowed (progressive files have about 10; libjpeg-turbo's tools advise 100)."""
MIN_PNG_CHUNK = 256
"""A PNG may have one chunk per this many bytes on average (besides ``MAX_SEGMENTS``): the walk
that checks their lengths costs a few milliseconds on a 16 MiB file of the smallest chunks."""


@dataclass(frozen=True)
class ImageInfo:
    format: str
    width: int
    height: int
    orientation: int = 1
    """EXIF orientation, 1 (upright) to 8."""
    channels: int = 3
    """Samples per pixel as stored (a palette index counts as one), alpha included."""
    bits: int = 8
    """Bits per sample (8, 16 or 32)."""
    alpha: bool = False
    """The image has (or may have) transparency."""
    grey: bool = False
    """Grey levels only (decoded to one channel, made colour after the resize)."""
    scans: int = 1
    """JPEG: the number of scans; more than one makes libjpeg keep every DCT coefficient."""
    samples: int = 0
    """JPEG: samples of all components at full size, whole 8x8 blocks (chroma subsampling counted)."""

    @property
    def pixels(self) -> int:
        return self.width * self.height


_TIFF_INTEGERS = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 16: "Q", 17: "q"}
"""The struct format of each integer type of a TIFF entry (BYTE, SHORT, LONG, their signed forms,
LONG8 and SLONG8): libtiff reads a tag given in any of them, so the probe does too."""


def _tiff_tags(data: bytes, wanted: set[int]) -> dict[int, int]:
    """Integer values of the wanted tags in the first IFD of a TIFF structure (also EXIF's); for a
    tag with several values (BitsPerSample), the first. Read as libtiff reads them, so that the
    header the limits are checked on is the one decoded: a tag given twice counts once, its first
    entry (libtiff ignores the later ones; taking the last, a TIFF whose first ImageWidth and
    ImageLength said 20,000 and a later pair 1 passed as 1x1 and decoded to 400 MB); a value
    libtiff would refuse (negative) is left out."""
    if len(data) < 8 or data[:2] not in (b"II", b"MM"):
        return {}
    endian = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack_from(endian + "I", data, 4)
    if ifd + 2 > len(data):
        return {}
    (count,) = struct.unpack_from(endian + "H", data, ifd)
    found: dict[int, int] = {}
    seen: set[int] = set()
    for i in range(min(count, 512)):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(data):
            break
        tag, typ, n = struct.unpack_from(endian + "HHI", data, entry)
        if tag not in wanted or tag in seen:
            continue
        seen.add(tag)
        kind = _TIFF_INTEGERS.get(typ)
        if kind is None or n == 0:
            continue
        size = struct.calcsize(kind)
        # inline when all its values fit the entry's 4 bytes, else at an offset
        offset = entry + 8 if n * size <= 4 else struct.unpack_from(endian + "I", data, entry + 8)[0]
        if offset + size <= len(data):
            (value,) = struct.unpack_from(endian + kind, data, offset)
            if value >= 0:
                found[tag] = value
    return found


def _skip_fill(data: bytes, pos: int) -> int:
    """Position of the marker code after the 0xFF at ``pos`` and any fill bytes after it."""
    end = pos + 1
    while end < len(data) and data[end] == 0xFF:
        end += 1
        if end - pos > MAX_FILL:
            raise BadImage(f"corrupt JPEG: more than {MAX_FILL} fill bytes before a marker")
    return end


def _jpeg_samples(sof: bytes, width: int, height: int) -> int:
    """Samples of every component, in whole blocks, from a frame header's sampling factors."""
    factors = [(sof[7 + 3 * i] >> 4, sof[7 + 3 * i] & 15) for i in range(sof[5]) if 8 + 3 * i < len(sof)]
    factors = [(max(1, h), max(1, v)) for h, v in factors] or [(1, 1)]
    hmax, vmax = max(h for h, _ in factors), max(v for _, v in factors)
    total = 0
    for h, v in factors:
        cols = -(-width * h // hmax)
        rows = -(-height * v // vmax)
        total += -(-cols // 8) * 8 * -(-rows // 8) * 8
    return total


def _jpeg_scans(data: bytes, sos: int, progressive: bool, components: int, scan_components: int) -> int:
    """How many scans the decoder will run. Progressive files are counted: every scan starts with an
    SOS marker, and in entropy-coded data 0xFF is always followed by 0x00 or a restart marker, so the
    pair counts scans (in C; only progressive files pay for it). A sequential file puts each
    component in exactly one scan, so its first scan says it all: all components at once, one scan."""
    if not progressive:
        return 1 if scan_components >= components else components
    scans = data.count(b"\xff\xda", sos)
    if scans > MAX_SCANS:
        raise BadImage(f"JPEG has {scans} scans; at most {MAX_SCANS} are accepted")
    return max(scans, 2)  # a progressive decode always buffers the coefficients


def _jpeg(data: bytes) -> ImageInfo:
    pos, orientation, segments = 2, 1, 0
    frame: tuple[int, bytes] | None = None
    """(SOF marker, its segment), once seen."""
    window = data[:HEADER_WINDOW]
    n = len(window)
    while pos + 4 <= n:
        if window[pos] != 0xFF:
            raise BadImage("corrupt JPEG: expected a marker")
        pos = _skip_fill(window, pos) - 1  # pos: the last 0xFF, pos + 1: the marker code
        if pos + 4 > n:
            break
        marker = window[pos + 1]
        segments += 1
        if segments > MAX_SEGMENTS:
            raise BadImage(f"corrupt JPEG: more than {MAX_SEGMENTS} segments before the first scan")
        if marker in _NO_LENGTH:
            pos += 2
            continue
        (length,) = struct.unpack_from(">H", window, pos + 2)
        if length < 2:
            raise BadImage("corrupt JPEG: segment length under 2")
        segment = window[pos + 4 : pos + 2 + length]
        if marker == 0xE1 and segment.startswith(b"Exif\x00\x00"):
            orientation = _tiff_tags(segment[6:], {_ORIENTATION_TAG}).get(_ORIENTATION_TAG, 1)
        elif marker in _JPEG_SOF and len(segment) >= 6 and frame is None:
            frame = (marker, segment)
        elif marker == 0xDA:
            if frame is None:
                break
            return _jpeg_info(frame, orientation, data, pos, segment[0] if segment else 0)
        pos += 2 + length
    if frame is not None:  # no scan within the window (or truncated): assume the costly case
        return _jpeg_info(frame, orientation, data, None, 0)
    if n == HEADER_WINDOW and pos + 4 > n:
        raise BadImage(f"JPEG frame header not within the first {HEADER_WINDOW} bytes")
    raise BadImage("corrupt JPEG: no frame header found")


def _jpeg_info(
    frame: tuple[int, bytes], orientation: int, data: bytes, sos: int | None, scan_components: int
) -> ImageInfo:
    marker, segment = frame
    height, width = struct.unpack_from(">HH", segment, 1)
    components = segment[5]
    progressive = marker in _JPEG_PROGRESSIVE
    scans = 2 if sos is None else _jpeg_scans(data, sos, progressive, components, scan_components)
    return ImageInfo(
        "jpeg",
        width,
        height,
        orientation if 1 <= orientation <= 8 else 1,
        channels=max(1, components),
        bits=16 if segment[0] > 8 else 8,
        grey=components == 1,
        scans=scans,
        samples=_jpeg_samples(segment, width, height),
    )


def _exif_orientation(tiff: bytes) -> int:
    """The orientation an EXIF block (a TIFF structure, after an ``Exif\\0\\0`` prefix or not)
    gives, 1 where it gives none or one out of range."""
    orientation = _tiff_tags(tiff.removeprefix(b"Exif\x00\x00"), {_ORIENTATION_TAG}).get(_ORIENTATION_TAG, 1)
    return orientation if 1 <= orientation <= 8 else 1


def _png_orientation(data: bytes) -> int:
    """The EXIF orientation of an ``eXIf`` chunk before the image data (where PNG's extension puts
    it, and OpenCV's decoder, which applies it, reads it), walking at most ``MAX_SEGMENTS`` chunks
    within ``HEADER_WINDOW`` bytes."""
    pos = 8
    for _ in range(MAX_SEGMENTS):
        if pos + 8 > min(len(data), HEADER_WINDOW):
            break
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf":
            return _exif_orientation(data[pos + 8 : pos + 8 + length])
        if kind in (b"IDAT", b"IEND"):
            break
        pos += 12 + length
    return 1


def _png_chunks_fit(data: bytes) -> None:
    """Refuse a PNG one of whose chunks says more bytes than the file has left. OpenCV's reader
    allocates (and zeroes) a chunk's declared length before reading it: a 75-byte PNG whose IDAT
    said 1 GB took 1 GB and 0.8 s to refuse as truncated, and a few saying 4 GB each, in one
    request, ended the gateway. At most ``MAX_SEGMENTS`` chunks, and one per ``MIN_PNG_CHUNK``
    bytes, are walked; a PNG of more is refused (real ones have one per 8-64 KiB of image data)."""
    pos, end = 8, len(data)
    most = MAX_SEGMENTS + end // MIN_PNG_CHUNK
    header = struct.Struct(">I4s").unpack_from
    for _ in range(most):
        if pos + 8 > end:
            return
        length, kind = header(data, pos)
        if length > end - pos - 8:
            raise BadImage(
                f"truncated PNG: its {kind.decode('latin-1')!r} chunk says {length} bytes, {end - pos - 8} are left"
            )
        if kind == b"IEND":
            return
        pos += 12 + length
    raise BadImage(f"corrupt PNG: more than {most} chunks ({MIN_PNG_CHUNK} bytes each on average)")


def _png(data: bytes) -> ImageInfo:
    if data[12:16] != b"IHDR" or len(data) < 26:
        raise BadImage("corrupt PNG: no IHDR chunk")
    _png_chunks_fit(data)
    w, h, depth, colour = struct.unpack_from(">IIBB", data, 16)
    if colour not in _PNG_COLOUR or depth not in (1, 2, 4, 8, 16):
        raise BadImage(f"corrupt PNG: colour type {colour} with bit depth {depth}")
    channels, alpha = _PNG_COLOUR[colour]
    # A palette or grey image may still carry transparency in a tRNS chunk; assume it may.
    alpha = alpha or (colour in (0, 2, 3) and b"tRNS" in data[: data.find(b"IDAT")])
    return ImageInfo(
        "png",
        w,
        h,
        _png_orientation(data),
        channels=channels,
        bits=16 if depth == 16 else 8,
        alpha=alpha,
        grey=colour == 0,
    )


def _webp_orientation(data: bytes) -> int:
    """The EXIF orientation of an extended WebP's ``EXIF`` chunk (after the image data, usually:
    the RIFF chunks are skipped by their sizes, at most ``MAX_SEGMENTS`` of them)."""
    if not data[20] & 0x08:  # VP8X: no EXIF chunk
        return 1
    pos = 12
    for _ in range(MAX_SEGMENTS):
        if pos + 8 > len(data):
            break
        kind, length = struct.unpack_from("<4sI", data, pos)
        if kind == b"EXIF":
            return _exif_orientation(data[pos + 8 : pos + 8 + length])
        pos += 8 + length + (length & 1)
    return 1


def _webp(data: bytes) -> ImageInfo:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30:
        w, h = struct.unpack_from("<HH", data, 26)
        return ImageInfo("webp", w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25:
        (bits,) = struct.unpack_from("<I", data, 21)
        alpha = bool(bits >> 28 & 1)
        return ImageInfo(
            "webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, channels=4 if alpha else 3, alpha=alpha
        )
    if chunk == b"VP8X" and len(data) >= 30:
        alpha = bool(data[20] & 0x10)
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return ImageInfo("webp", w, h, _webp_orientation(data), channels=4 if alpha else 3, alpha=alpha)
    raise BadImage("corrupt WebP header")


def _bmp(data: bytes) -> ImageInfo:
    (dib,) = struct.unpack_from("<I", data, 14)
    if dib == 12:
        w, h, _, bitcount = struct.unpack_from("<HHHH", data, 18)
    else:
        w, h, _, bitcount = struct.unpack_from("<iiHH", data, 18)
    alpha = bitcount == 32
    return ImageInfo("bmp", abs(w), abs(h), channels=4 if alpha else 3, alpha=alpha)


def _tiff(data: bytes) -> ImageInfo:
    wanted = {_TIFF_WIDTH, _TIFF_HEIGHT, _TIFF_BITS, _TIFF_SAMPLES, _TIFF_EXTRA, _TIFF_PHOTOMETRIC, _ORIENTATION_TAG}
    tags = _tiff_tags(data, wanted)
    if _TIFF_WIDTH not in tags or _TIFF_HEIGHT not in tags:
        raise BadImage("corrupt TIFF: no dimensions in the first IFD")
    orientation = tags.get(_ORIENTATION_TAG, 1)
    samples = min(max(tags.get(_TIFF_SAMPLES, 1), 1), 4)
    bits = tags.get(_TIFF_BITS, 8)
    return ImageInfo(
        "tiff",
        tags[_TIFF_WIDTH],
        tags[_TIFF_HEIGHT],
        orientation if 1 <= orientation <= 8 else 1,
        channels=samples,
        bits=8 if bits <= 8 else 16 if bits <= 16 else 32,
        alpha=_TIFF_EXTRA in tags or samples in (2, 4),
        grey=samples == 1 and tags.get(_TIFF_PHOTOMETRIC, 1) in (0, 1),
    )


def probe(data: bytes) -> ImageInfo:
    """Identify the image; raise BadImage for empty, truncated or unrecognised bytes."""
    if not data:
        raise BadImage("empty image")
    try:
        if data.startswith(b"\xff\xd8\xff"):
            return _jpeg(data)
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            return _png(data)
        if data[:6] in (b"GIF87a", b"GIF89a"):
            w, h = struct.unpack_from("<HH", data, 6)
            return ImageInfo("gif", w, h, channels=4, alpha=True)  # transparency is per frame
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
        if data[:2] == b"BM":
            return _bmp(data)
        if data[:4] in (b"II*\x00", b"MM\x00*"):
            return _tiff(data)
    except struct.error:
        raise BadImage("truncated image header") from None
    raise BadImage("not a recognised image (JPEG, PNG, GIF, WebP, BMP or TIFF expected)")
