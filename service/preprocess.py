"""Decode and resize images with OpenCV: pure, synchronous functions, run in a thread pool.

``prepare`` turns encoded bytes into the model's input: a uint8 RGB array of shape
``(size, size, 3)``, the centre square of the image (``crop_fraction`` of the shorter side), upright
per its EXIF orientation. JPEGs much larger than needed are decoded at 1/2, 1/4 or 1/8 scale by
libjpeg itself, which is several times faster than decoding the full image and resizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from service.errors import BadImage, PayloadTooLarge
from service.imageinfo import ImageInfo, probe

_REDUCED = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))
# Orientation is applied by us, after the crop: OpenCV's reduced modes silently ignore it.
_IGNORE_ORIENTATION = cv2.IMREAD_IGNORE_ORIENTATION


@dataclass(frozen=True)
class PreprocessConfig:
    image_size: int = 224
    crop_fraction: float = 0.875
    max_pixels: int = 50_000_000

    @property
    def needed_short_side(self) -> int:
        """Shorter side the decoded image needs so the crop is not upscaled."""
        return round(self.image_size / self.crop_fraction)


def reduction_for(info: ImageInfo, needed_short_side: int) -> int:
    """The largest JPEG DCT scaling factor that keeps the shorter side at least as long as needed."""
    if info.format != "jpeg":
        return 1
    short = min(info.width, info.height)
    for factor, _ in _REDUCED:
        if short // factor >= needed_short_side:
            return factor
    return 1


def _to_bgr8(img: np.ndarray) -> np.ndarray:
    """Any decoded array (gray, gray+alpha, BGR, BGRA; 8 or 16 bit, or float) to 8-bit BGR, with
    transparency composited over white."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    elif img.dtype in (np.float32, np.float64):
        img = (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise BadImage(f"unsupported sample type {img.dtype}")
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    channels = img.shape[2]
    if channels == 3:
        return img
    if channels == 1:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    if channels in (2, 4):
        colour: np.ndarray = cv2.cvtColor(img[:, :, :1], cv2.COLOR_GRAY2BGR) if channels == 2 else img[:, :, :3]
        alpha = img[:, :, channels - 1 : channels].astype(np.float32) / 255.0
        blended = colour.astype(np.float32) * alpha + 255.0 * (1.0 - alpha)
        out: np.ndarray = (blended + 0.5).astype(np.uint8)
        return out
    raise BadImage(f"unsupported channel count {channels}")


def decode(data: bytes, info: ImageInfo, needed_short_side: int) -> np.ndarray:
    """Decode to 8-bit BGR, at reduced scale when the JPEG is large enough, orientation not applied."""
    buf = np.frombuffer(data, np.uint8)
    factor = reduction_for(info, needed_short_side)
    if info.format == "jpeg":
        flag = dict(_REDUCED).get(factor, cv2.IMREAD_COLOR)
        img = cv2.imdecode(buf, flag | _IGNORE_ORIENTATION)
    else:
        img = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
    if img is None or img.size == 0:
        raise BadImage(f"{info.format.upper()} data could not be decoded (truncated or corrupt)")
    return _to_bgr8(img)


def centre_crop_resize(img: np.ndarray, size: int, crop_fraction: float) -> np.ndarray:
    """Resize-shorter-side-then-centre-crop as one crop and one resize of the source pixels."""
    h, w = img.shape[:2]
    side = max(1, round(min(h, w) * crop_fraction))
    y, x = (h - side) // 2, (w - side) // 2
    square = img[y : y + side, x : x + side]
    interpolation = cv2.INTER_AREA if side > size else cv2.INTER_LINEAR
    return cv2.resize(square, (size, size), interpolation=interpolation)


def orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """Apply an EXIF orientation (1-8) so the image is shown upright."""
    if orientation == 2:
        return cv2.flip(img, 1)
    if orientation == 3:
        return cv2.rotate(img, cv2.ROTATE_180)
    if orientation == 4:
        return cv2.flip(img, 0)
    if orientation == 5:
        return cv2.transpose(img)
    if orientation == 6:
        return cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE)
    if orientation == 7:
        return cv2.rotate(cv2.transpose(img), cv2.ROTATE_180)
    if orientation == 8:
        return cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return img


def check_limits(info: ImageInfo, config: PreprocessConfig) -> None:
    if info.width == 0 or info.height == 0:
        raise BadImage(f"{info.format.upper()} header says the image is {info.width}x{info.height}")
    if info.pixels > config.max_pixels:
        raise PayloadTooLarge(
            f"image is {info.width}x{info.height} = {info.pixels} pixels; the limit is {config.max_pixels}"
        )


def prepare(data: bytes, config: PreprocessConfig) -> np.ndarray:
    """Encoded image bytes to the model input: uint8 RGB ``(size, size, 3)``."""
    info = probe(data)
    check_limits(info, config)
    img = decode(data, info, config.needed_short_side)
    img = centre_crop_resize(img, config.image_size, config.crop_fraction)
    img = orient(img, info.orientation)  # the centre square rotates onto itself
    # cvtColor, not img[:, :, ::-1].copy(): 40x faster (4 vs 169 us at 224x224) and it releases the GIL
    rgb: np.ndarray = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return rgb
