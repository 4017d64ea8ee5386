"""JPEG decoding on the GPU: ``GATEWAY_DECODER=nvjpeg`` (nvJPEG's CUDA decoder, through torchvision's
``decode_jpeg``) or ``GATEWAY_DECODER=nvimagecodec`` (nvImageCodec: the GPU's hardware JPEG decoder,
as on A100/H100, first, then its CUDA decoder).

The same contract as ``service.images.preprocess.prepare`` (encoded bytes in, the model's uint8 RGB
``(height, width, 3)`` out, errors as ``GatewayError``), with the same semantics: the header is probed
and checked against the same limits first; then the same ``Plan`` (``service.images.geometry``: crop,
stretch or letterbox, worked out in the decoded frame) takes the region and resizes it (antialiased
when shrinking, as OpenCV's INTER_AREA; bilinear with half-pixel centres when enlarging, as
INTER_LINEAR), the EXIF orientation is applied to the result, and a letterbox is padded with grey.
Pixels differ from OpenCV's by rounding and by the two decoders' IDCTs, a level or two.

Not every image goes to the GPU: other formats than JPEG, and JPEGs the GPU decoder refuses
(progressive or arithmetic-coded ones some nvJPEG builds do not take, CMYK, corrupt data), are
decoded by OpenCV in the same thread, counted in ``gateway_decode_fallbacks_total{reason}``. A
corrupt image thus gets the same 400 ``bad_image`` as with the CPU decoder.

The images of one request are decoded together (``prepare_many``): one batched call, each image
cropped and resized on the GPU, and one copy of them all back to the host, instead of a
synchronising copy per image. nvJPEG's batched call fails whole when one image is refused (each is
then tried alone); nvImageCodec's answers each image on its own (None where refused), so only the
refused ones go to OpenCV. nvImageCodec is asked for RGB without its EXIF rotation: the resized
image is oriented here, as on the CPU path.

This module imports torch (and nvImageCodec) only when the decoder is built; the gateway without
``GATEWAY_DECODER`` never needs them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from service.images.budget import Budget
from service.images.geometry import LETTERBOX_GREY
from service.images.imageinfo import ImageInfo, probe
from service.images.preprocess import PreprocessConfig, check_limits, prepare

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DecodeJpeg = Callable[..., Any]
"""torchvision's ``decode_jpeg(data, mode=..., device=...)``: uint8 CHW RGB."""
DecodeImages = Callable[[list[bytes]], list[Any]]
"""nvImageCodec's ``Decoder.decode`` with its parameters bound: per image, an HWC uint8 RGB image
on the GPU (``__cuda_array_interface__``), or None where it was refused."""


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


def resize_chw(img: torch.Tensor, config: PreprocessConfig, orientation: int = 1) -> torch.Tensor:
    """A uint8 CHW image as decoded (EXIF ``orientation`` not applied) made the model's CHW input on
    its device: ``prepare``'s plan (``PreprocessConfig.plan``), resized, oriented, letterboxed."""
    import torch
    import torch.nn.functional as F

    _, h, w = img.shape
    plan = config.plan(h, w, orientation)
    region = img[:, plan.y : plan.y + plan.height, plan.x : plan.x + plan.width].unsqueeze(0).float()
    shrinks = plan.height > plan.resized[0] or plan.width > plan.resized[1]  # antialiasing is per axis
    resized = F.interpolate(region, size=plan.resized, mode="bilinear", antialias=shrinks, align_corners=False)
    content = orient_chw(resized.squeeze(0).round_().clamp_(0, 255).to(img.dtype), orientation)
    if config.resize != "letterbox":
        return content
    canvas = torch.full((img.shape[0], config.height, config.width), LETTERBOX_GREY, dtype=img.dtype, device=img.device)
    canvas[:, plan.top : plan.top + content.shape[1], plan.left : plan.left + content.shape[2]] = content
    return canvas


def _cuda_device(device: str, setting: str) -> None:
    """Refuse a GPU decoder where ``device`` is no CUDA device this process sees."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise RuntimeError(f"GATEWAY_DECODER={setting} needs a CUDA device; {device!r} is not one here")


class GpuDecoder:
    """``prepare`` with JPEGs decoded on ``device`` by a GPU decoder (``_decode``: a subclass's);
    everything else as the module's docstring says, whichever decoder."""

    def __init__(self, device: str, on_fallback: Callable[[str], None]) -> None:
        """``on_fallback(reason)`` is told of each image decoded on the CPU instead: ``format`` (not
        a JPEG) or ``refused`` (a JPEG the GPU decoder refused)."""
        import torch

        self.device = torch.device(device)
        self.on_fallback = on_fallback

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
            inputs = self._decode_inputs(
                [datas[i] for i in jpegs], [info.orientation for info in jpegs.values()], config
            )
        except Exception as exc:  # one image the GPU decoder refuses fails the whole call
            logger.debug("the GPU decoder refused a batch of %d (%s)", len(jpegs), exc)
            for i, info in jpegs.items():
                out[i] = self._alone(datas[i], info, config, budget, deadline, retry=len(jpegs) > 1)
            return out
        for (i, info), one in zip(jpegs.items(), inputs, strict=True):
            out[i] = one if one is not None else self._alone(datas[i], info, config, budget, deadline, False)
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
                (one,) = self._decode_inputs([data], [info.orientation], config)
                if one is not None:
                    return one
        self.on_fallback("refused")
        return _outcome(prepare, data, config, budget, deadline, info)

    def _decode(self, datas: list[bytes]) -> list[torch.Tensor | None]:
        """JPEGs decoded in one call: uint8 CHW RGB on the device, None where refused (or raise)."""
        raise NotImplementedError

    def _decode_inputs(
        self, datas: list[bytes], orientations: list[int], config: PreprocessConfig
    ) -> list[np.ndarray | None]:
        """JPEGs decoded in one call, made the model's input on the device (``resize_chw``), then
        copied back to the host together: HWC uint8 arrays (None where the decoder refused the image)."""
        import torch

        inputs: list[torch.Tensor | None] = []
        for img, orientation in zip(self._decode(datas), orientations, strict=True):
            if img is None:
                inputs.append(None)
                continue
            if img.ndim != 3 or img.shape[0] != 3:
                raise ValueError(f"decoded to {tuple(img.shape)}, not 3 channels")
            inputs.append(resize_chw(img, config, orientation))
        done = [one for one in inputs if one is not None]
        host = iter(list(torch.stack(done).permute(0, 2, 3, 1).contiguous().cpu().numpy()) if done else [])
        return [next(host) if one is not None else None for one in inputs]


class NvJpegDecoder(GpuDecoder):
    """``GATEWAY_DECODER=nvjpeg``: nvJPEG's CUDA decoder, through torchvision's batched ``decode_jpeg``."""

    def __init__(self, device: str, on_fallback: Callable[[str], None], decode_jpeg: DecodeJpeg | None = None) -> None:
        """``decode_jpeg``: a stand-in for torchvision's (tests); None takes torchvision's."""
        if decode_jpeg is None:
            try:
                from torchvision.io import ImageReadMode
                from torchvision.io import decode_jpeg as torchvision_decode_jpeg
            except ImportError as exc:
                raise RuntimeError(
                    f"GATEWAY_DECODER=nvjpeg needs torchvision built for CUDA (pip install '.[gpu]'): {exc}"
                ) from None
            _cuda_device(device, "nvjpeg")
            decode_jpeg = partial(torchvision_decode_jpeg, mode=ImageReadMode.RGB)  # grey and CMYK too
        super().__init__(device, on_fallback)
        self._decode_jpeg = decode_jpeg

    def _decode(self, datas: list[bytes]) -> list[torch.Tensor | None]:
        import torch

        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
        return list(self._decode_jpeg(encoded, device=self.device))


NVIMAGECODEC_BACKENDS = ("HW_GPU_ONLY", "GPU_ONLY")
"""nvImageCodec's decoders the gateway uses, in order: the hardware JPEG engines, then CUDA."""


class NvImageCodecDecoder(GpuDecoder):
    """``GATEWAY_DECODER=nvimagecodec``: nvImageCodec, the hardware JPEG decoder where the GPU has
    one, else its CUDA decoder."""

    def __init__(
        self,
        device: str,
        on_fallback: Callable[[str], None],
        decode: DecodeImages | None = None,
        backends: tuple[str, ...] = NVIMAGECODEC_BACKENDS,
    ) -> None:
        """``decode``: a stand-in for nvImageCodec's (tests); None builds nvImageCodec's, with
        ``backends`` (its ``BackendKind`` names) in the order it tries them."""
        super().__init__(device, on_fallback)
        self._decode_images = decode if decode is not None else _nvimagecodec(device, backends)

    def _decode(self, datas: list[bytes]) -> list[torch.Tensor | None]:
        import torch

        return [
            None if image is None else torch.as_tensor(image, device=self.device).permute(2, 0, 1)
            for image in self._decode_images(datas)
        ]


def _nvimagecodec(device: str, backends: tuple[str, ...]) -> DecodeImages:
    """nvImageCodec's batched decode on ``device`` with ``backends`` (e.g. the hardware decoder
    first, the CUDA decoder next); RGB, EXIF orientation not applied (the input is oriented after
    resizing, as on the CPU)."""
    import torch

    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        raise RuntimeError(
            f"GATEWAY_DECODER=nvimagecodec needs nvImageCodec (pip install nvidia-nvimgcodec-cu13): {exc}"
        ) from None
    _cuda_device(device, "nvimagecodec")
    try:
        kinds = [getattr(nvimgcodec.BackendKind, name) for name in backends]
    except AttributeError as exc:
        raise RuntimeError(f"nvImageCodec has no such backend: {exc}") from None
    index = torch.device(device).index or 0
    params = nvimgcodec.DecodeParams(
        color_spec=nvimgcodec.ColorSpec.SRGB, sample_format=nvimgcodec.SampleFormat.I_RGB, apply_exif_orientation=False
    )
    local = threading.local()

    def decode(datas: list[bytes]) -> list[Any]:
        """On this decode thread's own decoder (nothing says one may be called from several threads
        at once), on the thread's current CUDA stream, where the crop and resize then run."""
        decoder = getattr(local, "decoder", None)
        if decoder is None:
            decoder = local.decoder = nvimgcodec.Decoder(
                device_id=index, backends=[nvimgcodec.Backend(kind) for kind in kinds]
            )
        streams = [_code_stream(nvimgcodec, data) for data in datas]
        parsed = [code for code in streams if code is not None]
        stream = torch.cuda.current_stream(index).cuda_stream
        images = iter(decoder.decode(parsed, params=params, cuda_stream=stream) if parsed else ())
        return [None if code is None else next(images) for code in streams]

    return decode


def _code_stream(nvimgcodec: Any, data: bytes) -> Any:
    """nvImageCodec's parsed header of ``data``, or None where it cannot parse one (that image goes
    to OpenCV, which gives the client its error)."""
    try:
        return nvimgcodec.CodeStream(data)
    except Exception:
        return None


_PENDING: Exception = Exception("not decoded yet")


def _outcome(decode: Callable[..., np.ndarray], *args: Any) -> np.ndarray | Exception:
    try:
        return decode(*args)
    except Exception as exc:
        return exc
