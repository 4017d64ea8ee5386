"""The resize modes (crop, stretch, letterbox) at square and non-square sizes, against a reference
written independently with Pillow: the upright photo (``ImageOps.exif_transpose``), then Pillow's own
resize, crop box and paste. Every mode x size x EXIF orientation 1-8; the tolerance is shown to fail
deliberately wrong geometries (orientation ignored or turned the wrong way, an uncentred crop, the
target transposed). Then the exact placement of a letterbox's grey, a panorama stretched, 1x1 and
tiny images, and JPEGs decoded at reduced scale only as far as nothing is enlarged."""

from __future__ import annotations

import io
import math
from functools import cache

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from skimage import data as skdata

from service.errors import BadImage
from service.images.geometry import LETTERBOX_GREY, Resize, enlarges, plan
from service.images.imageinfo import probe
from service.images.preprocess import PreprocessConfig, orient, prepare, reduction_for, resize_region

MODES: tuple[Resize, ...] = ("crop", "stretch", "letterbox")
SIZES = {"square": (224, 224), "tall": (260, 200), "wide": (200, 300)}
"""(height, width) of the model's input."""
TOLERANCE = 5.0
"""Mean absolute difference (levels) allowed between ``prepare`` and the Pillow reference: the two
libraries' interpolations and a crop rounded to whole pixels give up to 4 on the cat's fur; every
wrong geometry tried gives 15 or more (``test_the_tolerance_fails_wrong_geometries``)."""
BILINEAR = Image.Resampling.BILINEAR  # antialiased when shrinking, as OpenCV's INTER_AREA


def encoded(photo: np.ndarray, orientation: int, fmt: str = "JPEG") -> bytes:
    """``photo`` stored as it is, with an EXIF ``orientation`` saying how to show it upright."""
    image = Image.fromarray(photo)
    exif = image.getexif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, fmt, exif=exif.tobytes(), **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@cache
def photo_bytes(name: str, orientation: int) -> bytes:
    photos = {"chelsea": skdata.chelsea, "coffee": skdata.coffee}
    return encoded(photos[name](), orientation)


def upright(data: bytes) -> Image.Image:
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def reference(
    picture: Image.Image, height: int, width: int, resize: Resize, crop_fraction: float = 0.875
) -> np.ndarray:
    """The model's input as Pillow makes it from the upright ``picture``: the covering size's centre
    (a sub-pixel crop box), the whole picture stretched, or the picture fitted and centred on grey."""
    w, h = picture.size
    if resize == "stretch":
        return np.asarray(picture.resize((width, height), BILINEAR))
    if resize == "crop":
        scale = max(height / crop_fraction / h, width / crop_fraction / w)
        box_w, box_h = width / scale, height / scale
        box = ((w - box_w) / 2, (h - box_h) / 2, (w + box_w) / 2, (h + box_h) / 2)
        return np.asarray(picture.resize((width, height), BILINEAR, box=box))
    scale = min(height / h, width / w)
    fitted = picture.resize((max(1, round(w * scale)), max(1, round(h * scale))), BILINEAR)
    canvas = Image.new("RGB", (width, height), (LETTERBOX_GREY,) * 3)
    canvas.paste(fitted, ((width - fitted.width) // 2, (height - fitted.height) // 2))
    return np.asarray(canvas)


def difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.abs(ours.astype(np.int16) - theirs.astype(np.int16)).mean())


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
@pytest.mark.parametrize("resize", MODES)
@pytest.mark.parametrize("name", ["chelsea", "coffee"])
def test_every_mode_size_and_orientation_is_pillows_picture(
    name: str, resize: Resize, size: str, orientation: int
) -> None:
    """A photo stored with each EXIF orientation becomes, in each mode and at a square, a tall and a
    wide size, the input Pillow makes from the upright photo: the orientation's quarter turns swap
    the geometry worked out in the decoded frame, never the picture's."""
    data = photo_bytes(name, orientation)
    height, width = SIZES[size]
    ours = prepare(data, PreprocessConfig(height, width, resize))
    assert ours.shape == (height, width, 3)
    assert difference(ours, reference(upright(data), height, width, resize)) < TOLERANCE


def _wrong_references(data: bytes, height: int, width: int, resize: Resize) -> dict[str, np.ndarray]:
    """References made with a geometry mistake each."""
    picture, stored = upright(data), Image.open(io.BytesIO(data)).convert("RGB")
    orientation = probe(data).orientation
    wrong = {"orientation ignored": reference(stored, height, width, resize)}
    if orientation in (6, 8):  # turned the other way: 180 degrees from upright
        wrong["turned the wrong way"] = reference(picture.transpose(Image.Transpose.ROTATE_180), height, width, resize)
    if height != width:  # made at the target's sides swapped, then transposed to its shape
        wrong["target transposed"] = reference(picture, width, height, resize).transpose(1, 0, 2)
    if resize == "crop":
        w, h = picture.size
        scale = max(height / 0.875 / h, width / 0.875 / w)
        box = (0, 0, width / scale, height / scale)  # the corner, not the centre
        wrong["uncentred crop"] = np.asarray(picture.resize((width, height), BILINEAR, box=box))
        wrong["stretched instead"] = reference(picture, height, width, "stretch")
        if height != width:
            scale = max(width / 0.875 / h, height / 0.875 / w)
            box = ((w - height / scale) / 2, (h - width / scale) / 2, (w + height / scale) / 2, (h + width / scale) / 2)
            wrong["crop of the swapped aspect"] = np.asarray(picture.resize((width, height), BILINEAR, box=box))
    return {why: image for why, image in wrong.items() if image.shape == (height, width, 3)}


@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
@pytest.mark.parametrize("resize", MODES)
def test_the_tolerance_fails_wrong_geometries(resize: Resize, size: str, orientation: int) -> None:
    """The comparison above tells a geometry mistake apart: ``prepare``'s input is over the
    tolerance from every reference made wrongly (the orientation ignored or turned the wrong way,
    the target transposed, a crop from the corner, a stretch for a crop)."""
    data = photo_bytes("chelsea", orientation)
    height, width = SIZES[size]
    ours = prepare(data, PreprocessConfig(height, width, resize))
    wrong = _wrong_references(data, height, width, resize)
    assert wrong
    for why, image in wrong.items():
        assert difference(ours, image) > 2 * TOLERANCE, why


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", [(224, 224), (260, 200), (200, 300), (7, 5)], ids=str)
@pytest.mark.parametrize("resize", MODES)
def test_the_decoded_frame_gives_orient_first_pixel_for_pixel(
    resize: Resize, size: tuple[int, int], orientation: int
) -> None:
    """Worked out in the decoded frame and oriented last, the input is the one OpenCV makes from the
    image oriented first, within a level of rounding: a centred region with an odd pixel to spare
    sits where the upright picture puts it, whichever axes the orientation reverses."""
    raw = cv2.resize(skdata.chelsea(), (333, 257))  # odd sides: centring has an odd pixel to spare
    config = PreprocessConfig(*size, resize=resize)
    ours = orient(resize_region(raw, config.plan(257, 333, orientation)), orientation)
    turned = orient(raw, orientation)
    plan = config.plan(turned.shape[0], turned.shape[1], 1)
    first = resize_region(turned, plan)
    assert ours.shape == first.shape
    assert np.abs(ours.astype(int) - first).max() <= 1
    assert (config.plan(257, 333, orientation).top, config.plan(257, 333, orientation).left) == (plan.top, plan.left)


def _png(rgb: np.ndarray, orientation: int = 1) -> bytes:
    return encoded(rgb, orientation, "PNG")


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("stored", [(98, 400), (400, 98)], ids=["landscape", "portrait"])
def test_letterbox_pads_with_grey_114_centred_the_odd_pixel_after(stored: tuple[int, int], orientation: int) -> None:
    """A 400 x 98 red picture letterboxed into 224 x 224 is 224 x 55 of red with 84 grey rows above
    and 85 below (the YOLO convention: the odd pixel at the bottom); upright 98 x 400 (stored turned,
    or portrait as it is), the same bands are columns, the odd one at the right."""
    red = np.zeros((*stored, 3), np.uint8)
    red[:, :] = (255, 0, 0)
    out = prepare(_png(red, orientation), PreprocessConfig(224, 224, "letterbox"))
    if (stored[0] > stored[1]) != (orientation >= 5):  # upright portrait: look at it by columns
        out = out.transpose(1, 0, 2)
    assert (out[:84] == LETTERBOX_GREY).all()
    assert (out[84 + 55 :] == LETTERBOX_GREY).all()
    assert (out[84 : 84 + 55] == (255, 0, 0)).all()


@pytest.mark.parametrize("kind", ["grey", "alpha", "16 bits"])
def test_letterbox_pads_every_decode_path(kind: str) -> None:
    """Grey, transparent and 16-bit pictures are converted after the resize and padded the same
    way: the bands are 114, the picture its colour (transparent: white), written into the array given."""
    if kind == "grey":
        data = _png(np.full((50, 200), 30, np.uint8))
        colour: tuple[int, ...] = (30, 30, 30)
    elif kind == "alpha":
        data = _png(np.zeros((50, 200, 4), np.uint8))
        colour = (255, 255, 255)
    else:
        data = cv2.imencode(".png", np.full((50, 200, 3), 0x8000, np.uint16))[1].tobytes()
        colour = (128, 128, 128)
    cell = np.zeros((100, 160, 3), np.uint8)
    out = prepare(data, PreprocessConfig(100, 160, "letterbox"), into=lambda: cell)
    assert out is cell
    assert (out[:30] == LETTERBOX_GREY).all()
    assert (out[70:] == LETTERBOX_GREY).all()
    assert (out[30:70] == colour).all()


def test_a_panorama_is_stretched_whole_and_antialiased() -> None:
    """A 2400 x 200 panorama stretched to 224 x 224 keeps all of it (its left and right ends'
    colours at the input's edges), and its one-pixel stripes are averaged to grey, not aliased:
    the width shrinks 10x while the height grows, which OpenCV's INTER_AREA alone does not average."""
    stripes = np.zeros((200, 2400, 3), np.uint8)
    stripes[:, 1::2] = 255
    stripes[:, :100] = (255, 0, 0)
    stripes[:, -100:] = (0, 0, 255)
    out = prepare(_png(stripes), PreprocessConfig(224, 224, "stretch")).astype(int)
    assert (np.abs(out[:, :5] - (255, 0, 0)) <= 2).all()
    assert (np.abs(out[:, -5:] - (0, 0, 255)) <= 2).all()
    middle = out[:, 20:-20]  # each column averages 10.7 stripes (aliased: 0 or 255)
    assert np.abs(middle - 127.5).max() <= 16, (middle.min(), middle.max())
    photo = cv2.resize(skdata.coffee(), (2400, 300), interpolation=cv2.INTER_AREA)
    data = encoded(photo, 1)
    ours = prepare(data, PreprocessConfig(260, 200, "stretch"))
    assert difference(ours, reference(upright(data), 260, 200, "stretch")) < TOLERANCE


@pytest.mark.parametrize("size", SIZES.values(), ids=list(SIZES))
@pytest.mark.parametrize("resize", MODES)
def test_a_one_pixel_image_fills_the_input(resize: Resize, size: tuple[int, int]) -> None:
    """A 1x1 picture is its colour everywhere a picture goes: all of the input, or a letterbox's
    largest centred square (the rest grey)."""
    height, width = size
    out = prepare(_png(np.array([[[10, 20, 30]]], np.uint8)), PreprocessConfig(height, width, resize))
    inside = out
    if resize == "letterbox":
        side = min(height, width)
        top, left = (height - side) // 2, (width - side) // 2
        inside = out[top : top + side, left : left + side]
    assert (inside == (10, 20, 30)).all()
    assert (out == (10, 20, 30)).all(axis=2).sum() == inside.shape[0] * inside.shape[1]
    assert ((out == LETTERBOX_GREY).all(axis=2) | (out == (10, 20, 30)).all(axis=2)).all()


@pytest.mark.parametrize("size", SIZES.values(), ids=list(SIZES))
@pytest.mark.parametrize("resize", MODES)
@pytest.mark.parametrize("orientation", [1, 6])
def test_a_tiny_image_is_enlarged_as_pillow_enlarges_it(
    resize: Resize, size: tuple[int, int], orientation: int
) -> None:
    """A 6 x 4 picture enlarged (bilinear, half-pixel centres in both libraries) to each size and
    mode. A crop takes whole pixels (Pillow's box, fractions of one): a tiny picture's crop is
    compared where it is whole: all of a 4 x 4, at crop fraction 1, to a square."""
    tiny = np.random.default_rng(4).integers(0, 256, (4, 6, 3), np.uint8)
    height, width = size
    crop_fraction = 0.875
    if resize == "crop":
        tiny, crop_fraction, width = tiny[:, :4], 1.0, height
    data = _png(np.ascontiguousarray(tiny), orientation)
    ours = prepare(data, PreprocessConfig(height, width, resize, crop_fraction))
    assert difference(ours, reference(upright(data), height, width, resize, crop_fraction)) < TOLERANCE


def _expected_factor(width: int, height: int, config: PreprocessConfig) -> int:
    """The largest JPEG scale factor at which nothing the input takes is enlarged, from the upright
    sides: covering the crop's size, both sides (stretch), one side (letterbox)."""
    for factor in (8, 4, 2):
        w, h = width // factor, height // factor
        if config.resize == "crop":
            serves = h * config.crop_fraction >= config.height and w * config.crop_fraction >= config.width
        elif config.resize == "stretch":
            serves = h >= config.height and w >= config.width
        else:
            serves = h >= config.height or w >= config.width
        if serves:
            return factor
    return 1


@cache
def big_jpeg(orientation: int) -> bytes:
    """2400 x 1600 as stored (landscape), with ``orientation``."""
    return encoded(cv2.resize(skdata.coffee(), (2400, 1600), interpolation=cv2.INTER_CUBIC), orientation)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", [*SIZES.values(), (600, 150), (150, 600)], ids=[*SIZES, "very-tall", "very-wide"])
@pytest.mark.parametrize("resize", MODES)
def test_a_jpeg_is_decoded_small_only_as_far_as_nothing_is_enlarged(
    resize: Resize, size: tuple[int, int], orientation: int
) -> None:
    """The JPEG scale factor (1/2, 1/4, 1/8) is the largest at which every side the input takes
    from the upright picture is still as long as the input needs, in every mode (stretching needs
    both sides, letterboxing one): a tall input of a picture stored turned needs its stored width."""
    data = big_jpeg(orientation)
    info = probe(data)
    config = PreprocessConfig(*size, resize=resize)
    width, height = (1600, 2400) if orientation >= 5 else (2400, 1600)
    assert reduction_for(info, config) == _expected_factor(width, height, config)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 5000),
    st.integers(1, 8),
    st.tuples(st.integers(1, 1000), st.integers(1, 1000)),
    st.sampled_from(MODES),
    st.floats(0.05, 1.0),
)
def test_the_reduced_scale_check_is_the_plans(
    height: int, width: int, orientation: int, out: tuple[int, int], resize: Resize, crop_fraction: float
) -> None:
    """The check JPEG's reduced scales use (``enlarges``, without making a plan) says what the plan
    does: a crop or a stretch enlarges exactly when its plan does; a letterbox it passes never
    enlarges (one it refuses may just fit, by rounding: that image is decoded larger, not worse)."""
    made = plan(height, width, orientation, out, resize, crop_fraction)
    if resize == "letterbox":
        assert made.enlarges <= enlarges(height, width, orientation, out, resize, crop_fraction)
    else:
        assert made.enlarges == enlarges(height, width, orientation, out, resize, crop_fraction)


@pytest.mark.parametrize("orientation", [1, 6])
@pytest.mark.parametrize("resize", MODES)
def test_a_reduced_decode_gives_the_full_decodes_picture(resize: Resize, orientation: int) -> None:
    """Decoded at reduced scale, the tall input is what Pillow makes from the full-size picture."""
    data = big_jpeg(orientation)
    config = PreprocessConfig(260, 200, resize)
    assert reduction_for(probe(data), config) > 1
    assert difference(prepare(data, config), reference(upright(data), 260, 200, resize)) < TOLERANCE


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"height": 0}, "height must be a whole number"),
        ({"width": -3}, "width must be a whole number"),
        ({"height": 2.5}, "height must be a whole number"),
        ({"width": True}, "width must be a whole number"),
        ({"resize": "fill"}, "resize must be one of crop, stretch, letterbox, not 'fill'"),
        ({"crop_fraction": 0.0}, r"crop_fraction must be in \(0, 1\]"),
        ({"crop_fraction": 1.5}, r"crop_fraction must be in \(0, 1\]"),
        ({"crop_fraction": math.nan}, r"crop_fraction must be in \(0, 1\]"),
    ],
    ids=str,
)
def test_a_config_out_of_range_is_refused_by_name(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreprocessConfig(**values)  # type: ignore[arg-type]


def test_bad_images_are_still_bad_in_every_mode() -> None:
    """A truncated JPEG is a 400 whatever the mode."""
    for resize in MODES:
        with pytest.raises(BadImage):
            prepare(photo_bytes("coffee", 6)[:2000], PreprocessConfig(260, 200, resize))
