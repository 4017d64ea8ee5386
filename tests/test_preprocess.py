from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from skimage import data as skdata

from service.errors import BadImage, GatewayError, PayloadTooLarge
from service.imageinfo import probe
from service.preprocess import PreprocessConfig, centre_crop_resize, prepare, reduction_for
from tests.conftest import crafted_png

CONFIG = PreprocessConfig()


def pil_bytes(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF"])
def test_every_supported_format_probes_and_prepares(fmt: str) -> None:
    photo = Image.fromarray(skdata.chelsea())  # 451 x 300
    encoded = pil_bytes(photo, fmt)
    info = probe(encoded)
    assert (info.width, info.height) == (451, 300)
    out = prepare(encoded, CONFIG)
    assert out.shape == (224, 224, 3)
    assert out.dtype == np.uint8


def test_output_is_rgb_centre_crop() -> None:
    """Left third red, middle green, right third blue (RGB): the centre crop is green, in RGB order."""
    rgb = np.zeros((300, 900, 3), np.uint8)
    rgb[:, :300, 0] = 255
    rgb[:, 300:600, 1] = 255
    rgb[:, 600:, 2] = 255
    out = prepare(pil_bytes(Image.fromarray(rgb), "PNG"), CONFIG)
    assert tuple(out[112, 112]) == (0, 255, 0)
    assert tuple(out[112, 0]) == (0, 255, 0)  # 0.875 of 300 px is inside the middle third


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", [(300, 200), (1800, 1200)], ids=["small", "reduced-decode"])
def test_exif_orientation_is_applied(orientation: int, size: tuple[int, int]) -> None:
    """Each EXIF orientation gives the upright picture, as Pillow's exif_transpose shows it; also when
    the JPEG is big enough to be decoded at reduced scale, where OpenCV itself ignores orientation."""
    base = np.zeros((size[1], size[0], 3), np.uint8)
    base[: size[1] // 2, : size[0] // 2] = (255, 0, 0)  # a red quadrant top-left marks the orientation
    base[size[1] // 2 :, :, 2] = 200
    stored = Image.fromarray(base)
    exif = stored.getexif()
    exif[0x0112] = orientation
    encoded = pil_bytes(stored, "JPEG", exif=exif.tobytes(), quality=95)
    assert probe(encoded).orientation == orientation
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(encoded))))
    expected = centre_crop_resize(upright, 224, CONFIG.crop_fraction)
    diff = np.abs(prepare(encoded, CONFIG).astype(int) - expected.astype(int))
    assert diff.mean() < 6


def test_large_jpeg_is_decoded_at_reduced_scale_and_matches_full_decode() -> None:
    big = cv2.resize(skdata.chelsea(), (3608, 2400), interpolation=cv2.INTER_CUBIC)
    encoded = pil_bytes(Image.fromarray(big), "JPEG", quality=92)
    assert reduction_for(probe(encoded), CONFIG.needed_short_side) == 8
    full = centre_crop_resize(big, 224, CONFIG.crop_fraction)
    diff = np.abs(prepare(encoded, CONFIG).astype(int) - full.astype(int))
    assert diff.mean() < 6


def test_grayscale_becomes_three_equal_channels() -> None:
    gray = (np.arange(300 * 300) % 251).astype(np.uint8).reshape(300, 300)
    out = prepare(pil_bytes(Image.fromarray(gray), "PNG"), CONFIG)
    assert out.shape == (224, 224, 3)
    assert np.array_equal(out[..., 0], out[..., 1])
    assert np.array_equal(out[..., 1], out[..., 2])


def test_transparency_is_composited_over_white() -> None:
    rgba = np.zeros((100, 100, 4), np.uint8)  # black, fully transparent
    rgba[40:60, 40:60] = (255, 0, 0, 255)  # an opaque red square in the middle
    out = prepare(pil_bytes(Image.fromarray(rgba), "PNG"), CONFIG)
    assert tuple(out[5, 5]) == (255, 255, 255)
    assert tuple(out[112, 112]) == (255, 0, 0)


def test_sixteen_bit_png_is_scaled_to_eight_bits() -> None:
    wide = np.full((64, 64, 3), 0x8000, np.uint16)
    wide[:, :, 0] = 0xFF00
    ok, encoded = cv2.imencode(".png", wide)
    assert ok
    out = prepare(encoded.tobytes(), CONFIG)
    assert tuple(out[100, 100]) == (128, 128, 255)  # BGR 16-bit in, RGB 8-bit out


def test_cmyk_jpeg_keeps_its_colours() -> None:
    rgb = np.zeros((200, 200, 3), np.uint8)
    rgb[:, :] = (200, 30, 30)
    encoded = pil_bytes(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95)
    out = prepare(encoded, CONFIG).astype(int)
    assert abs(out[112, 112] - np.array([200, 30, 30])).max() < 20


def test_one_pixel_image_is_upscaled() -> None:
    out = prepare(pil_bytes(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG"), CONFIG)
    assert out.shape == (224, 224, 3)
    assert tuple(out[0, 0]) == (10, 20, 30)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"hello, this is a text file pretending to be a jpeg", "not a recognised image"),
        (b"\xff\xd8\xff", "no frame header"),
    ],
    ids=["empty", "text", "bare-jpeg-marker"],
)
def test_bad_bytes_are_bad_images(data: bytes, message: str) -> None:
    with pytest.raises(BadImage, match=message):
        prepare(data, CONFIG)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_is_a_bad_image(fmt: str) -> None:
    encoded = pil_bytes(Image.fromarray(skdata.chelsea()), fmt)
    with pytest.raises(BadImage, match="could not be decoded"):
        prepare(encoded[: len(encoded) // 2], CONFIG)


def test_decompression_bomb_is_refused_from_the_header() -> None:
    """A PNG claiming 50,000 x 50,000 pixels is refused before decoding (decoding would need 7.5 GB)."""
    with pytest.raises(PayloadTooLarge, match="50000x50000"):
        prepare(crafted_png(50_000, 50_000), CONFIG)


def test_jpeg_dimensions_over_the_limit_are_refused() -> None:
    encoded = pil_bytes(Image.new("RGB", (400, 300)), "JPEG")
    with pytest.raises(PayloadTooLarge):
        prepare(encoded, PreprocessConfig(max_pixels=400 * 300 - 1))
    assert prepare(encoded, PreprocessConfig(max_pixels=400 * 300)).shape == (224, 224, 3)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from([b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF"]))
def test_random_bytes_never_crash(payload: bytes, prefix: bytes) -> None:
    """Random bytes, bare or behind an image signature, give an image or a GatewayError, nothing else."""
    try:
        out = prepare(prefix + payload, CONFIG)
    except GatewayError:
        return
    assert out.shape == (224, 224, 3)
