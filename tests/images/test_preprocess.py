from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from skimage import data as skdata

from loadtests.harness import decode_cases
from service.errors import BadImage, GatewayError, PayloadTooLarge
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, centre_crop_resize, prepare, reduction_for
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
    assert reduction_for(probe(encoded), CONFIG) == 8
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
    """Half an image is a 400: a JPEG's found by the decoder, a PNG's by its chunk lengths."""
    encoded = pil_bytes(Image.fromarray(skdata.chelsea()), fmt)
    with pytest.raises(BadImage, match="could not be decoded" if fmt == "JPEG" else "truncated PNG"):
        prepare(encoded[: len(encoded) // 2], CONFIG)


def test_decompression_bomb_is_refused_from_the_header() -> None:
    """A PNG claiming 50,000 x 50,000 pixels is refused before decoding (decoding would need 7.5 GB)."""
    with pytest.raises(PayloadTooLarge, match="50000x50000"):
        prepare(crafted_png(50_000, 50_000), CONFIG)


def test_jpeg_over_the_decoded_bytes_budget_is_refused() -> None:
    encoded = pil_bytes(Image.new("RGB", (400, 300)), "JPEG")
    with pytest.raises(PayloadTooLarge, match="400x300"):
        prepare(encoded, PreprocessConfig(max_image_bytes=2 * 400 * 300 * 3 - 1))
    assert prepare(encoded, PreprocessConfig(max_image_bytes=2 * 400 * 300 * 3)).shape == (224, 224, 3)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from([b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF89a", b"RIFF"]))
def test_random_bytes_never_crash(payload: bytes, prefix: bytes) -> None:
    """Random bytes, bare or behind an image signature, give an image or a GatewayError, nothing else."""
    try:
        out = prepare(prefix + payload, CONFIG)
    except GatewayError:
        return
    assert out.shape == (224, 224, 3)


@pytest.mark.parametrize("case", decode_cases.CASES, ids=[c.name for c in decode_cases.CASES])
def test_decoding_stays_within_the_bytes_budget(case: decode_cases.Case, tmp_path: Path) -> None:
    """For every accepted format, bit depth and alpha, the peak memory of preparing an image (in a
    fresh process) stays within what the header reckons: the budget GATEWAY_MAX_IMAGE_BYTES is
    compared with. Full-resolution float conversions (1.7 GB for a 7000x7000 RGBA PNG) broke this."""
    measured = decode_cases.measure(decode_cases.make(case, tmp_path, scale=0.45))
    assert measured["peak"] <= measured["estimate"] + 24e6, measured  # + decoder working buffers (WebP: ~12 MB)


def test_an_rgba_png_over_the_budget_is_refused_before_decoding() -> None:
    """A 7000x7000 RGBA PNG compresses to ~200 KB; decoding it takes 392 MB, over the default budget."""
    with pytest.raises(PayloadTooLarge, match=r"7000x7000 \(PNG, 4 channel"):
        prepare(crafted_png(7000, 7000, colour_type=6), CONFIG)


@pytest.mark.parametrize(("mode", "depth"), [("RGBA", 8), ("RGBA", 16), ("LA", 8)])
def test_alpha_is_composited_over_white_after_the_resize(mode: str, depth: int) -> None:
    """Transparent pixels come out white and edges do not bleed the hidden colour, at 8 and 16 bits,
    grey or colour: the result matches compositing at full size and then resizing."""
    rng = np.random.default_rng(1)
    h, w = 600, 800
    colour = rng.integers(0, 256, (h, w, 3), dtype=np.uint16) * 257
    alpha = np.zeros((h, w, 1), np.uint16)
    alpha[100:500, 150:650] = 65535
    alpha[:, 390:410] = 30000  # a half-transparent band through the middle
    if mode == "LA":
        colour = np.repeat(colour[:, :, :1], 3, axis=2)
    bgra = np.concatenate([colour, alpha], axis=2)
    if depth == 8:
        bgra = (bgra >> 8).astype(np.uint8)
    if mode == "RGBA":
        encoded = cv2.imencode(".png", bgra)[1].tobytes()
    else:  # OpenCV cannot write grey + alpha
        encoded = pil_bytes(Image.fromarray(np.ascontiguousarray(bgra[:, :, [0, 3]]), "LA"), "PNG")
    top = 65535.0 if depth == 16 else 255.0
    a = bgra[:, :, 3:].astype(np.float64) / top
    over_white = (bgra[:, :, :3].astype(np.float64) / top * a + (1 - a)) * 255
    expected = centre_crop_resize(over_white.astype(np.float32), 224, CONFIG.crop_fraction)[:, :, ::-1]
    out = prepare(encoded, CONFIG).astype(np.float64)
    assert np.abs(out - expected).max() <= 2.0
    assert tuple(out[2, 2]) == (255, 255, 255)


def _jpeg_with(middle: bytes) -> bytes:
    sof2 = b"\xff\xc2\x00\x11\x08\x00\x10\x00\x10\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + middle + sof2 + b"\xff\xd9"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xd8" + b"\xff" * (8 << 20), "fill bytes"),
        (_jpeg_with(b"\xff\xfe\x00\x02" * 10_000), "segments"),
        (_jpeg_with((b"\xff\xe2\xff\xff" + b"\x00" * 65533) * 17), "frame header not within"),
        (_jpeg_with(b"")[:-2] + b"\xff\xda\x00\x02" * 150 + b"\xff\xd9", "150 scans"),
    ],
    ids=["fill-run", "segments", "header-beyond-window", "scans"],
)
def test_hostile_jpeg_headers_are_refused_by_a_bounded_walk(data: bytes, message: str) -> None:
    """8 MiB of fill bytes (0.5 s of Python before), 10,000 empty segments, a frame header hidden
    past the window, or 150 progressive scans (each one more decoder pass over the whole image)
    are refused from the header, before any decoding."""
    with pytest.raises(BadImage, match=message):
        probe(data)


def _images_of_every_path() -> dict[str, bytes]:
    """One image down each way ``prepare`` ends: RGB as it is, every EXIF orientation, grey, alpha,
    16 bits, CMYK."""
    photo = Image.fromarray(skdata.chelsea())
    cases = {"rgb jpeg": pil_bytes(photo, "JPEG"), "rgb png": pil_bytes(photo, "PNG")}
    for orientation in range(2, 9):
        exif = photo.getexif()
        exif[0x0112] = orientation
        cases[f"orientation {orientation}"] = pil_bytes(photo, "JPEG", exif=exif.tobytes())
    cases["grey"] = pil_bytes(photo.convert("L"), "PNG")
    cases["alpha"] = pil_bytes(photo.convert("RGBA"), "PNG")
    cases["cmyk"] = pil_bytes(photo.convert("CMYK"), "JPEG")
    ok, wide = cv2.imencode(".png", (skdata.chelsea().astype(np.uint16) * 257))
    assert ok
    cases["16 bits"] = wide.tobytes()
    return cases


@pytest.mark.parametrize("case", list(_images_of_every_path()))
def test_an_image_is_written_into_the_array_it_is_given(case: str) -> None:
    """``into`` (the shared engine's cell): whichever way the image is decoded it ends in that very
    array, with the pixels it gets without one; an array of another shape is left alone."""
    encoded = _images_of_every_path()[case]
    cell = np.full((224, 224, 3), 7, np.uint8)
    got = prepare(encoded, CONFIG, into=lambda: cell)
    assert got is cell
    np.testing.assert_array_equal(got, prepare(encoded, CONFIG))
    assert prepare(encoded, CONFIG, into=lambda: None).shape == (224, 224, 3)
    wrong = np.zeros((100, 100, 3), np.uint8)
    assert prepare(encoded, CONFIG, into=lambda: wrong).shape == (224, 224, 3)
    assert not wrong.any()


def test_a_bad_image_takes_no_array_to_write_into() -> None:
    """The array is asked for only once the image has decoded: a bad or oversized upload never
    holds one of the shared engine's cells."""
    asked: list[int] = []

    def into() -> np.ndarray:
        asked.append(1)
        return np.zeros((224, 224, 3), np.uint8)

    for bad in (b"\xff\xd8\xff" + bytes(100), crafted_png(50_000, 50_000), crafted_png(300, 200)):
        with pytest.raises(GatewayError):
            prepare(bad, CONFIG, into=into)
    assert asked == []
