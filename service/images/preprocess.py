"""Decode and resize images with OpenCV: pure, synchronous functions, run in a thread pool.

``prepare`` turns encoded bytes into the model's input: a uint8 RGB array of shape
``(height, width, 3)``, made from the upright picture (per its EXIF orientation) by the model's
resize mode (``service.images.geometry``: crop, stretch or letterbox). JPEGs much larger than needed
are decoded at 1/2, 1/4 or 1/8 scale by libjpeg itself, which is several times faster than decoding
the full image and resizing; never so small that the result is enlarged where the full image would
not have been.

Memory is bounded by bytes, not pixels: ``decoded_bytes`` reckons from the header what the decoder
will hold (channels, bit depth, a progressive JPEG's coefficients), and ``check_limits`` refuses an
image over the budget before decoding (and ``prepare`` reserves that much from a budget shared by
the decode threads). Images without alpha are decoded straight to 8-bit BGR
(16-bit ones too); images with alpha or float samples keep their samples, and every conversion
(depth, alpha over white, grey to colour) happens after the crop and resize, on the model's pixels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from service.errors import BadImage, PayloadTooLarge
from service.images.budget import Budget
from service.images.geometry import LETTERBOX_GREY, RESIZE_MODES, Plan, Resize, enlarges, plan, quarter_turn
from service.images.imageinfo import ImageInfo, probe

_REDUCED = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))
_REDUCED_GREY = {
    8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
    4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
    2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
}
# Orientation is applied by us, after the resize: OpenCV's reduced modes silently ignore it.
_IGNORE_ORIENTATION = cv2.IMREAD_IGNORE_ORIENTATION


DECODER_MAX_SIDE = {"jpeg": 65_500, "png": 1_000_000, "webp": 16_383}
"""The longest side OpenCV's decoders take, by format (libjpeg's ``JPEG_MAX_DIMENSION``, libpng's
default user limit, WebP's own): a header over it is refused by name, before decoding, where
decoding it failed as "truncated or corrupt" (and offline, only in the worker)."""
OPENCV_MAX_SIDE = 1 << 20
"""The longest side OpenCV's ``imdecode`` takes in any format (``CV_IO_MAX_IMAGE_WIDTH`` and
``_HEIGHT``): past it, it fails an assertion, which a BMP or TIFF header reached (a 500)."""
OPENCV_MAX_PIXELS = 1 << 30
"""The most pixels ``imdecode`` decodes to (``CV_IO_MAX_IMAGE_PIXELS``; a JPEG's at its reduced
scale): a PNG of 40,000 x 40,000 reached it where ``max_image_bytes`` was raised to admit it."""


@dataclass(frozen=True)
class PreprocessConfig:
    """How a model's images are decoded, checked and shaped into its input."""

    height: int = 224
    width: int = 224
    resize: Resize = "crop"
    """How the picture becomes ``height x width`` (``service.images.geometry``)."""
    crop_fraction: float = 0.875
    """With ``resize = "crop"``: share of the covering size kept (0.875: 256 to 224)."""
    max_image_bytes: int = 300_000_000
    """Budget of decoder memory per image (see ``decoded_bytes``); larger images get 413."""

    def __post_init__(self) -> None:
        for name, side in (("height", self.height), ("width", self.width)):
            if not isinstance(side, int) or isinstance(side, bool) or side < 1:
                raise ValueError(f"preprocessing: {name} must be a whole number of pixels, at least 1, not {side!r}")
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"preprocessing: resize must be one of {', '.join(RESIZE_MODES)}, not {self.resize!r}")
        if not 0 < self.crop_fraction <= 1:  # also refuses nan
            raise ValueError(f"preprocessing: crop_fraction must be in (0, 1], not {self.crop_fraction!r}")

    def plan(self, height: int, width: int, orientation: int) -> Plan:
        """How a decoded ``height x width`` image with EXIF ``orientation`` becomes the input."""
        return plan(height, width, orientation, (self.height, self.width), self.resize, self.crop_fraction)


def reduction_for(info: ImageInfo, config: PreprocessConfig) -> int:
    """The largest JPEG DCT scaling factor at which the decoded image still has every pixel the
    model's input takes from it (nothing is enlarged that the full image would not enlarge): for a
    square crop, the shorter side at least ``size / crop_fraction``; stretching, both sides at least
    the input's; letterboxing, one of them."""
    if info.format != "jpeg":
        return 1
    out, resize, crop_fraction = (config.height, config.width), config.resize, config.crop_fraction
    for factor, _ in _REDUCED:
        height, width = info.height // factor, info.width // factor
        if height and width and not enlarges(height, width, info.orientation, out, resize, crop_fraction):
            return factor
    return 1


def _keeps_samples(info: ImageInfo) -> bool:
    """Decode with IMREAD_UNCHANGED (alpha, or float samples OpenCV cannot colour-convert); every
    other image is decoded straight to 8 bits, grey or BGR, whatever its depth."""
    return info.alpha or info.bits == 32


def decoded_bytes(info: ImageInfo, config: PreprocessConfig) -> int:
    """The most memory decoding this image takes. The decoded array counts twice: OpenCV decodes
    into its own buffer and the Python binding copies that into a NumPy array (measured: peak RSS
    growth is 2.0x the array for PNG, WebP and BMP). Beside it, a JPEG with several scans keeps every
    DCT coefficient (2 bytes per sample at full size, whatever the output scale), OpenCV's GIF reader
    a BGRA canvas, its TIFF reader a strip or tile buffer as large as the image at worst.
    ``python -m loadtests.decode_memory`` compares this with the measured peak per format."""
    return _decoded_bytes(info, reduction_for(info, config))


def _decoded_bytes(info: ImageInfo, factor: int) -> int:
    """``decoded_bytes`` of a JPEG decoded at 1 / ``factor`` (other formats: at full size)."""
    w, h = info.width, info.height
    if info.format == "jpeg":
        f = factor
        out = 2 * -(-w // f) * -(-h // f) * (1 if info.grey else 3)
        if info.scans > 1:
            out += 2 * (info.samples or w * h * info.channels)
        return out
    sample = 1 if not _keeps_samples(info) else max(1, info.bits // 8)
    out = 2 * w * h * (4 if info.alpha else 1 if info.grey else 3) * sample
    if info.format == "gif":
        out += w * h * 4
    elif info.format == "tiff":
        out += w * h * info.channels * max(1, info.bits // 8)
    return out


def _to_bgr8(img: np.ndarray) -> np.ndarray:
    """A small decoded array (gray, BGR, BGRA; 8 or 16 bit, or float) to 8-bit BGR, with
    transparency composited over white. Alpha arrives premultiplied (see ``_premultiply``)."""
    if img.ndim == 2:
        img = img[:, :, None]
    channels = img.shape[2]
    if channels not in (1, 2, 3, 4):
        raise BadImage(f"unsupported channel count {channels}")
    if img.dtype == np.uint8:
        scale = 1.0
    elif img.dtype == np.uint16:
        scale = 1.0 / 257.0
    elif img.dtype in (np.float32, np.float64):
        scale = 255.0
    else:
        raise BadImage(f"unsupported sample type {img.dtype}")
    values = img.astype(np.float32) * scale
    if channels in (2, 4):  # premultiplied colour over white: c + 255 * (1 - alpha)
        alpha = values[:, :, channels - 1 : channels]
        values = values[:, :, : channels - 1] + (255.0 - alpha)
    out: np.ndarray = np.clip(values + 0.5, 0, 255).astype(np.uint8)
    if out.shape[2] == 1:
        out = cv2.cvtColor(out, cv2.COLOR_GRAY2BGR)
    return out


def _premultiply(img: np.ndarray, rows: int = 256) -> None:
    """Multiply colour by alpha in place, a stripe at a time (bounded extra memory), so that
    resizing does not bleed the colour of transparent pixels into the picture."""
    channels = img.shape[2]
    top = 1.0 if img.dtype.kind == "f" else float(np.iinfo(img.dtype).max)
    for y in range(0, img.shape[0], rows):
        stripe = img[y : y + rows]
        alpha = stripe[:, :, channels - 1 : channels].astype(np.float32) * (1.0 / top)
        colour = stripe[:, :, : channels - 1].astype(np.float32) * alpha
        stripe[:, :, : channels - 1] = colour if img.dtype.kind == "f" else colour + 0.5


def decode(data: bytes, info: ImageInfo, config: PreprocessConfig) -> np.ndarray:
    """Decode at the smallest size and depth that serves: JPEGs at reduced scale when large enough,
    colour images without alpha straight to 8-bit RGB (the decoder writes RGB as cheaply as BGR, so
    no conversion pass follows), other images in OpenCV's BGR order; orientation not applied."""
    buf = np.frombuffer(data, np.uint8)
    factor = reduction_for(info, config)
    if _keeps_samples(info):
        flag = cv2.IMREAD_UNCHANGED
    elif info.grey:
        flag = _REDUCED_GREY.get(factor, cv2.IMREAD_GRAYSCALE)
    else:
        flag = (dict(_REDUCED).get(factor, cv2.IMREAD_COLOR) & ~cv2.IMREAD_COLOR) | cv2.IMREAD_COLOR_RGB
    img = cv2.imdecode(buf, flag | _IGNORE_ORIENTATION)
    if img is None or img.size == 0:
        raise BadImage(f"{info.format.upper()} data could not be decoded (truncated or corrupt)")
    return img


def decodes_to_rgb(info: ImageInfo) -> bool:
    """Whether ``decode`` gives this image as 8-bit RGB already."""
    return not _keeps_samples(info) and not info.grey


def resize_region(img: np.ndarray, plan: Plan, out: np.ndarray | None = None) -> np.ndarray:
    """``plan``'s region of ``img`` resized to ``plan.resized``: one crop (a view) and one resize of
    the source pixels (antialiased, INTER_AREA, when shrinking; INTER_LINEAR when enlarging). Where
    one axis shrinks and the other grows (a panorama stretched to a square), the shrinking axis is
    resized first, alone: INTER_AREA averages only where both axes shrink, and would alias it.

    The output array is made here, before the call: an array OpenCV allocates for its result is
    made inside the call, which then takes the GIL back for it while it has released it. In a
    decode thread that costs a wait for the GIL (up to the switch interval) in the middle of every
    resize while the event loop runs; given ``dst``, the resize runs from start to end without it.
    ``out``: where to write it, if it has the result's shape."""
    region = img[plan.y : plan.y + plan.height, plan.x : plan.x + plan.width]
    rows, columns = plan.resized
    shrinks = plan.height > rows or plan.width > columns
    if shrinks and plan.enlarges:
        step = (rows, plan.width) if plan.height > rows else (plan.height, columns)
        first = np.empty((*step, *img.shape[2:]), img.dtype)
        region = cv2.resize(region, step[::-1], dst=first, interpolation=cv2.INTER_AREA)
        shrinks = False
    interpolation = cv2.INTER_AREA if shrinks else cv2.INTER_LINEAR
    out = _fits(out, (rows, columns, *img.shape[2:]), img.dtype)
    resized: np.ndarray = cv2.resize(region, (columns, rows), dst=out, interpolation=interpolation)
    return resized  # ``out`` itself; a new array only if OpenCV's result had another layout


def centre_crop_resize(img: np.ndarray, size: int, crop_fraction: float, out: np.ndarray | None = None) -> np.ndarray:
    """Resize-shorter-side-then-centre-crop to ``size x size`` as one crop and one resize of the
    source pixels (``resize_region`` of a square crop's plan)."""
    h, w = img.shape[:2]
    return resize_region(img, plan(h, w, 1, (size, size), "crop", crop_fraction), out)


def _fits(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """``out`` if it can take a result of ``shape`` and ``dtype`` as it is (each row contiguous, as
    a region of a larger array is), else a new array."""
    if out is not None and out.shape == shape and out.dtype == dtype and out[0].flags.c_contiguous:
        return out
    return np.empty(shape, dtype)


def orient(img: np.ndarray, orientation: int, out: np.ndarray | None = None) -> np.ndarray:
    """Apply an EXIF orientation (1-8) so the image is shown upright. ``out``: where to write the
    result, if it has its shape (without it, an image needing no change is returned as it is)."""
    if out is not None:
        turned = (img.shape[1], img.shape[0], *img.shape[2:]) if quarter_turn(orientation) else img.shape
        out = _fits(out, turned, img.dtype)
    oriented: np.ndarray
    if orientation == 2:
        oriented = cv2.flip(img, 1, dst=out)
    elif orientation == 3:
        oriented = cv2.rotate(img, cv2.ROTATE_180, dst=out)
    elif orientation == 4:
        oriented = cv2.flip(img, 0, dst=out)
    elif orientation == 5:
        oriented = cv2.transpose(img, dst=out)
    elif orientation == 6:
        oriented = cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE, dst=out)
    elif orientation == 7:
        oriented = cv2.rotate(cv2.transpose(img), cv2.ROTATE_180, dst=out)
    elif orientation == 8:
        oriented = cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE, dst=out)
    elif out is not None:
        out[...] = img
        oriented = out
    else:
        oriented = img
    return oriented


def _canvas(
    out: np.ndarray | None, config: PreprocessConfig, plan: Plan, orientation: int
) -> tuple[np.ndarray, np.ndarray]:
    """The model input to write (``out`` if it fits) and the part of it the oriented picture goes
    to: all of it, or, letterboxing, its centre (the rest grey)."""
    whole = _fits(out, (config.height, config.width, 3), np.dtype(np.uint8))
    if config.resize != "letterbox":
        return whole, whole
    rows, columns = plan.resized[::-1] if quarter_turn(orientation) else plan.resized
    whole[...] = LETTERBOX_GREY
    return whole, whole[plan.top : plan.top + rows, plan.left : plan.left + columns]


def _put(result: np.ndarray, target: np.ndarray) -> None:
    """``result`` into ``target``, unless OpenCV wrote it there already."""
    if result is not target:
        target[...] = result


def check_limits(info: ImageInfo, config: PreprocessConfig) -> int:
    """Refuse an image the header says is empty or over the budget; return the bytes decoding takes."""
    if info.width == 0 or info.height == 0:
        raise BadImage(f"{info.format.upper()} header says the image is {info.width}x{info.height}")
    side = min(DECODER_MAX_SIDE.get(info.format, OPENCV_MAX_SIDE), OPENCV_MAX_SIDE)
    if max(info.width, info.height) > side:
        raise BadImage(
            f"{info.format.upper()} image is {info.width}x{info.height}: its decoder takes at most {side} pixels a side"
        )
    factor = reduction_for(info, config)
    needed = _decoded_bytes(info, factor)
    if needed > config.max_image_bytes:
        raise PayloadTooLarge(
            f"image is {info.width}x{info.height} ({info.format.upper()}, {info.channels} channel(s) of "
            f"{info.bits} bits{', ' + str(info.scans) + ' scans' if info.scans > 1 else ''}): decoding it "
            f"takes {needed / 1e6:.0f} MB; the limit is {config.max_image_bytes / 1e6:.0f} MB per image"
        )
    if -(-info.width // factor) * -(-info.height // factor) > OPENCV_MAX_PIXELS:
        raise BadImage(
            f"{info.format.upper()} image is {info.width}x{info.height}: its decoder takes at most "
            f"{OPENCV_MAX_PIXELS} pixels"
        )
    return needed


def prepare(
    data: bytes,
    config: PreprocessConfig,
    budget: Budget | None = None,
    deadline: float | None = None,
    info: ImageInfo | None = None,
    into: Callable[[], np.ndarray | None] | None = None,
) -> np.ndarray:
    """Encoded image bytes to the model input: uint8 RGB ``(config.height, config.width, 3)``.

    With a ``budget``, the decoder memory the header promises is reserved from it first (waiting,
    until ``deadline`` at most, while other threads hold it) and given back once the image is small.
    ``info``: the header, when the caller has probed it already. ``into``: where the result goes,
    asked for once the image has decoded (the shared engine's memory): a ``(height, width, 3)``
    uint8 array, returned, or None for a new one."""
    info = info or probe(data)
    needed = check_limits(info, config)
    if budget is None:
        return _prepare(data, info, config, into)
    with budget.hold(needed, deadline):
        return _prepare(data, info, config, into)


def _prepare(
    data: bytes, info: ImageInfo, config: PreprocessConfig, into: Callable[[], np.ndarray | None] | None
) -> np.ndarray:
    img = decode(data, info, config)
    plan = config.plan(img.shape[0], img.shape[1], info.orientation)
    out = into() if into is not None else None  # decoded: only the result is left to write
    if decodes_to_rgb(info):  # the common case: three 8-bit channels, RGB already
        whole, target = _canvas(out, config, plan, info.orientation)
        if info.orientation == 1:
            _put(resize_region(img, plan, target), target)
        else:
            _put(orient(resize_region(img, plan), info.orientation, target), target)
        return whole
    if img.ndim == 3 and img.shape[2] in (2, 4):
        _premultiply(img)
    img = resize_region(img, plan)  # at native depth, then convert
    if img.dtype != np.uint8 or img.ndim == 2 or img.shape[2] != 3:
        img = _to_bgr8(img)
    img = orient(img, info.orientation)
    whole, target = _canvas(out, config, plan, info.orientation)
    # cvtColor, not img[:, :, ::-1].copy(): 40x faster (4 vs 169 us at 224x224) and it releases the GIL
    _put(cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=target), target)
    return whole
