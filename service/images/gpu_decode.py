"""JPEG decoding on the GPU (nvJPEG through torchvision's ``decode_jpeg``): ``GATEWAY_DECODER=nvjpeg``.

The same contract as ``service.images.preprocess.prepare`` (encoded bytes in, the model's uint8 RGB
``(size, size, 3)`` out, errors as ``GatewayError``), with the same semantics: the header is probed
and checked against the same limits first; then the centre square of ``crop_fraction`` of the shorter
side is resized to ``size`` (antialiased when shrinking, as OpenCV's INTER_AREA; bilinear with
half-pixel centres when enlarging, as INTER_LINEAR), and the EXIF orientation is applied to that
square. Pixels differ from OpenCV's by rounding and by the two decoders' IDCTs, a level or two.

Not every image goes to the GPU: other formats than JPEG, and JPEGs the GPU decoder refuses
(progressive or arithmetic-coded ones some nvJPEG builds do not take, CMYK, corrupt data), are
decoded by OpenCV in the same thread, counted in ``gateway_decode_fallbacks_total{reason}``. A
corrupt image thus gets the same 400 ``bad_image`` as with the CPU decoder.

The images of one request are decoded together (``prepare_many``): one batched nvJPEG call, each
image cropped and resized on the GPU, and one copy of them all back to the host, instead of a
synchronising copy per image.

This module imports torch only when the decoder is built; the gateway without ``GATEWAY_DECODER``
never needs it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from service.images.budget import Budget
from service.images.imageinfo import ImageInfo, probe
from service.images.preprocess import PreprocessConfig, check_limits, prepare

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DecodeJpeg = Callable[..., Any]
"""torchvision's ``decode_jpeg(data, mode=..., device=...)``: uint8 CHW RGB."""


def orient_chw(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """An EXIF orientation (1-8) applied to a CHW image, as ``service.images.preprocess.orient`` does to HWC."""
    import torch

    if orientation == 2:
        return img.flip(-1)
    if orientation == 3:
        return img.flip(-1).flip(-2)
    if orientation == 4:
        return img.flip(-2)
    if orientation == 5:
        return img.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(img, k=-1, dims=(-2, -1))
    if orientation == 7:
        return img.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return torch.rot90(img, k=1, dims=(-2, -1))
    return img


def square_resize(img: torch.Tensor, size: int, crop_fraction: float) -> torch.Tensor:
    """The centre square of a uint8 CHW image resized to ``size``: ``centre_crop_resize`` on the device."""
    import torch.nn.functional as F

    _, h, w = img.shape
    side = max(1, round(min(h, w) * crop_fraction))
    y, x = (h - side) // 2, (w - side) // 2
    square = img[:, y : y + side, x : x + side].unsqueeze(0).float()
    resized = F.interpolate(square, size=(size, size), mode="bilinear", antialias=side > size, align_corners=False)
    return resized.squeeze(0).round_().clamp_(0, 255).to(img.dtype)


class NvJpegDecoder:
    """``prepare`` with JPEGs decoded on ``device`` (see the module's docstring)."""

    def __init__(self, device: str, on_fallback: Callable[[str], None], decode_jpeg: DecodeJpeg | None = None) -> None:
        """``on_fallback(reason)`` is told of each image decoded on the CPU instead: ``format`` (not
        a JPEG) or ``refused`` (a JPEG the GPU decoder refused)."""
        import torch

        if decode_jpeg is None:
            try:
                from torchvision.io import ImageReadMode
                from torchvision.io import decode_jpeg as torchvision_decode_jpeg
            except ImportError as exc:
                raise RuntimeError(
                    f"GATEWAY_DECODER=nvjpeg needs torchvision built for CUDA (pip install '.[gpu]'): {exc}"
                ) from None
            if not device.startswith("cuda") or not torch.cuda.is_available():
                raise RuntimeError(f"GATEWAY_DECODER=nvjpeg needs a CUDA device; {device!r} is not one here")
            decode_jpeg = partial(torchvision_decode_jpeg, mode=ImageReadMode.RGB)  # grey and CMYK too
        self.device = torch.device(device)
        self.on_fallback = on_fallback
        self._decode_jpeg = decode_jpeg

    def prepare(
        self, data: bytes, config: PreprocessConfig, budget: Budget | None = None, deadline: float | None = None
    ) -> np.ndarray:
        (outcome,) = self.prepare_many([data], config, budget, deadline)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def prepare_many(
        self,
        datas: list[bytes],
        config: PreprocessConfig,
        budget: Budget | None = None,
        deadline: float | None = None,
    ) -> list[np.ndarray | Exception]:
        """``prepare`` of each image, the JPEGs decoded in one batched call; each entry is the
        image's array or its error (the others are unaffected). If the batched call fails, each JPEG
        is tried alone, then by OpenCV."""
        out: list[np.ndarray | Exception] = []
        jpegs: dict[int, ImageInfo] = {}
        for i, data in enumerate(datas):
            try:
                info = probe(data)
                check_limits(info, config)
            except Exception as exc:
                out.append(exc)
                continue
            if info.format == "jpeg":
                jpegs[i] = info
                out.append(_PENDING)
            else:
                self.on_fallback("format")
                out.append(_outcome(prepare, data, config, budget, deadline, info))
        if not jpegs:
            return out
        try:
            squares = self._decode_squares(
                [datas[i] for i in jpegs], [info.orientation for info in jpegs.values()], config
            )
        except Exception as exc:  # one image the GPU decoder refuses fails the whole call
            logger.debug("nvjpeg refused a batch of %d (%s)", len(jpegs), exc)
            for i, info in jpegs.items():
                out[i] = self._alone(datas[i], info, config, budget, deadline, retry=len(jpegs) > 1)
            return out
        for i, square in zip(jpegs, squares, strict=True):
            out[i] = square
        return out

    def _alone(
        self,
        data: bytes,
        info: ImageInfo,
        config: PreprocessConfig,
        budget: Budget | None,
        deadline: float | None,
        retry: bool,
    ) -> np.ndarray | Exception:
        """One JPEG of a refused batch: on the GPU alone (``retry``), else by OpenCV, which decides
        (and names a bad image)."""
        if retry:
            with contextlib.suppress(Exception):
                return self._decode_squares([data], [info.orientation], config)[0]
        self.on_fallback("refused")
        return _outcome(prepare, data, config, budget, deadline, info)

    def _decode_squares(
        self, datas: list[bytes], orientations: list[int], config: PreprocessConfig
    ) -> list[np.ndarray]:
        """JPEGs decoded in one nvJPEG call, cropped, resized and oriented on the device, then copied
        back to the host together: HWC uint8 arrays."""
        import torch

        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
        decoded = self._decode_jpeg(encoded, device=self.device)
        squares = []
        for img, orientation in zip(decoded, orientations, strict=True):
            if img.ndim != 3 or img.shape[0] != 3:
                raise ValueError(f"decoded to {tuple(img.shape)}, not 3 channels")
            squares.append(orient_chw(square_resize(img, config.image_size, config.crop_fraction), orientation))
        host: np.ndarray = torch.stack(squares).permute(0, 2, 3, 1).contiguous().cpu().numpy()
        return list(host)


_PENDING: Exception = Exception("not decoded yet")


def _outcome(decode: Callable[..., np.ndarray], *args: Any) -> np.ndarray | Exception:
    try:
        return decode(*args)
    except Exception as exc:
        return exc
