"""Images at the edges of geometry on every decode path: the header probe (``imageinfo``), OpenCV's
``prepare`` (every way through it: colour, grey, alpha, 16-bit; JPEG's reduced-scale decodes) and
the offline validate path (``classifier.validate``). Each image gives a model input or a clear 400,
never another exception; and EXIF orientation is applied whatever the container."""

from __future__ import annotations

import asyncio
import contextlib
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image, ImageOps

from service.classifier import ImageInput, validate
from service.errors import BadImage
from service.images.imageinfo import probe
from service.images.preprocess import (
    DECODER_MAX_SIDE,
    OPENCV_MAX_PIXELS,
    OPENCV_MAX_SIDE,
    PreprocessConfig,
    check_limits,
    prepare,
)
from tests.images.edge_images import FORMATS, MODES, edge_image, geometries, header_sized, refused

CONFIG = PreprocessConfig()
CASES = [
    pytest.param(fmt, mode, w, h, id=f"{fmt}-{mode}-{w}x{h}")
    for fmt in FORMATS
    for mode in MODES[fmt]
    for w, h in geometries(fmt)
]


@pytest.mark.parametrize(("fmt", "mode", "width", "height"), CASES)
def test_edge_geometries_give_an_input_or_a_clear_400(fmt: str, mode: str, width: int, height: int) -> None:
    """1x1, 1xN, Nx1, 1x65535 and the longest side each decoder takes (and one past it), with
    every EXIF orientation: the probe reads the size and orientation, ``prepare`` gives a 224 x
    224 RGB input, and validation passes; or, for a side past the decoder's (libjpeg: 65,500, so
    1x65535 JPEG), all three refuse it with a 400 saying so (it was "truncated or corrupt" from the
    decoder, and offline it passed validation, to fail only in the worker)."""
    for orientation in range(1, 9):
        data = edge_image(fmt, width, height, orientation, mode)
        info = probe(data)
        assert (info.format, info.width, info.height, info.orientation) == (fmt, width, height, orientation)
        if refused(fmt, width, height):
            with pytest.raises(BadImage, match=f"at most {DECODER_MAX_SIDE[fmt]} pixels a side"):
                prepare(data, CONFIG)
            with pytest.raises(BadImage, match=f"at most {DECODER_MAX_SIDE[fmt]} pixels a side"):
                _validate(data)
            continue
        out = prepare(data, CONFIG)
        assert out.shape == (224, 224, 3)
        assert out.dtype == np.uint8
        _validate(data)


@pytest.mark.parametrize("fmt", ["bmp", "tiff"])
@pytest.mark.parametrize(
    ("width", "height"), [(OPENCV_MAX_SIDE + 1, 1), (1, OPENCV_MAX_SIDE + 1)], ids=["wide", "tall"]
)
def test_a_side_past_opencvs_is_a_clear_400_in_every_format(fmt: str, width: int, height: int) -> None:
    """A BMP or TIFF whose header says a side of 2^20 + 1 pixels (OpenCV's limit for any format;
    the image is small enough for the memory budget): ``prepare`` and validation refuse it with a
    400 naming the side, from the header (``imdecode`` failed an assertion: a 500)."""
    data = header_sized(fmt, width, height)
    assert (probe(data).width, probe(data).height) == (width, height)
    with pytest.raises(BadImage, match=f"at most {OPENCV_MAX_SIDE} pixels a side"):
        prepare(data, CONFIG)
    with pytest.raises(BadImage, match=f"at most {OPENCV_MAX_SIDE} pixels a side"):
        _validate(data)


def test_a_top_down_bmp_past_opencvs_side_is_a_clear_400() -> None:
    """A top-down BMP (negative height) of 1 x 2^20 + 1: refused by its side like any other."""
    with pytest.raises(BadImage, match=f"at most {OPENCV_MAX_SIDE} pixels a side"):
        prepare(header_sized("bmp", 1, -(OPENCV_MAX_SIDE + 1)), CONFIG)


def test_pixels_past_opencvs_are_a_clear_400_where_the_memory_budget_admits_them() -> None:
    """A PNG of 40,000 x 40,000, where ``max_image_bytes`` is raised to admit its memory: over
    OpenCV's 2^30 pixels, refused by name (``imdecode`` failed an assertion: a 500); a JPEG as large
    is decoded at 1/8 scale, under it, and passes the check."""
    roomy = PreprocessConfig(max_image_bytes=10**11)
    with pytest.raises(BadImage, match=f"at most {OPENCV_MAX_PIXELS} pixels"):
        prepare(header_sized("png", 40_000, 40_000), roomy)
    assert check_limits(probe(header_sized("jpeg", 40_000, 40_000)), roomy) > 0


def _validate(data: bytes) -> None:
    with ThreadPoolExecutor(1) as pool:
        asyncio.run(validate([ImageInput(data)], CONFIG, pool))


def _quadrants(fmt: str, orientation: int) -> bytes:
    """A 64 x 48 image, a red quadrant top-left, stored so that ``orientation`` shows it upright."""
    upright = np.zeros((48, 64, 3), np.uint8)
    upright[:24, :32] = (255, 0, 0)
    stored = Image.fromarray(upright)
    inverse = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM}
    inverse |= {5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE}
    inverse |= {8: Image.Transpose.ROTATE_270}
    if orientation in inverse:
        stored = stored.transpose(inverse[orientation])
    exif = stored.getexif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, FORMATS[fmt], exif=exif.tobytes(), **({"lossless": True} if fmt == "webp" else {}))
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["png", "webp"])
@pytest.mark.parametrize("orientation", range(2, 9))
def test_exif_orientation_of_png_and_webp_is_applied(fmt: str, orientation: int) -> None:
    """A PNG (``eXIf`` chunk) or WebP (``EXIF`` chunk) with an EXIF orientation is upright once
    prepared, as Pillow's ``exif_transpose`` shows it and as OpenCV's own decoder applies it; it
    was classified as stored (only JPEG's and TIFF's orientation was read)."""
    data = _quadrants(fmt, orientation)
    assert probe(data).orientation == orientation
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert upright.shape == (48, 64, 3)
    out = prepare(data, CONFIG)
    assert tuple(out[10, 10]) == (255, 0, 0)  # the red quadrant is top-left
    assert tuple(out[200, 200]) == (0, 0, 0)
    assert tuple(out[10, 200]) == (0, 0, 0)


@pytest.mark.parametrize("fmt", ["png", "webp"])
def test_a_bad_exif_block_leaves_the_image_as_stored(fmt: str) -> None:
    """An EXIF block that is not TIFF, or whose orientation is out of 1-8: the image is taken as
    stored (orientation 1), not refused; cut short anywhere in its EXIF chunk, the probe says
    what it can or refuses it as a bad image, never another exception."""
    data = _quadrants(fmt, 6)
    kind = b"eXIf" if fmt == "png" else b"EXIF"
    at = data.index(kind)
    for block in (b"not tiff at all".ljust(32, b"\x00"), _tiff_orientation(9), _tiff_orientation(0)):
        if fmt == "png":
            length = int.from_bytes(data[at - 4 : at], "big")
            crc = b"\x00" * 4  # (not checked by the probe, nor by OpenCV's reader of eXIf)
            broken = data[: at - 4] + len(block).to_bytes(4, "big") + kind + block + crc + data[at + 8 + length :]
        else:
            length = int.from_bytes(data[at + 4 : at + 8], "little")
            rest = data[at + 8 + length + (length & 1) :]
            broken = data[:at] + kind + len(block).to_bytes(4, "little") + block + rest
        assert probe(broken).orientation == 1
    for cut in range(at - 4, at + 40):
        with contextlib.suppress(BadImage):
            probe(data[:cut])


def _tiff_orientation(value: int) -> bytes:
    """A little-endian TIFF structure with one tag: Orientation = ``value``."""
    return (
        b"II*\x00\x08\x00\x00\x00\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00" + value.to_bytes(2, "little") + b"\x00" * 6
    )
