"""The GPU decoder's code on the CPU: its geometry and orientation against OpenCV's, its answers
through the real model, and its per-image fallbacks. nvJPEG itself needs a GPU; here a CPU JPEG
decoder stands in for it (``scripts/gpu-figures`` measures the real one on a device)."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from skimage import data as skdata

from service.errors import BadImage
from service.images.geometry import Resize
from service.images.gpu_decode import NvImageCodecDecoder, NvJpegDecoder, orient_chw, resize_chw
from service.images.preprocess import PreprocessConfig, centre_crop_resize, orient, prepare, resize_region
from service.metrics import Metrics
from service.models.profiles import get_profile
from service.models.store import model_path
from tests.conftest import encode, png_bytes
from tests.images.test_preprocess import pil_bytes

CONFIG = PreprocessConfig()


def cpu_decode_jpeg(
    encoded: torch.Tensor | list[torch.Tensor], device: torch.device
) -> torch.Tensor | list[torch.Tensor]:
    """Stands in for nvJPEG: uint8 CHW RGB, orientation not applied; a list in, a list out (as
    torchvision's batched call); one undecodable image fails the whole call (as nvJPEG's batch)."""
    if isinstance(encoded, list):
        return [cpu_decode_jpeg(one, device) for one in encoded]  # type: ignore[misc]
    rgb = cv2.imdecode(encoded.numpy(), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
    if rgb is None:
        raise RuntimeError("nvjpeg stand-in: cannot decode")
    return torch.from_numpy(rgb).permute(2, 0, 1).to(device)


def decoder(metrics: Metrics | None = None, decode_jpeg: object = cpu_decode_jpeg) -> NvJpegDecoder:
    counted = metrics or Metrics()
    return NvJpegDecoder("cpu", lambda reason: counted.decode_fallbacks.labels(reason).inc(), decode_jpeg=decode_jpeg)  # type: ignore[arg-type]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_is_opencvs(orientation: int) -> None:
    hwc = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), np.uint8)
    chw = torch.from_numpy(hwc).permute(2, 0, 1)
    assert np.array_equal(orient_chw(chw, orientation).permute(1, 2, 0).numpy(), orient(hwc, orientation))


@pytest.mark.parametrize("shape", [(300, 451), (196, 260), (1200, 900), (224, 224)])
def test_crop_and_resize_are_opencvs_within_rounding(cat_jpeg: bytes, shape: tuple[int, int]) -> None:
    """Shrinking (antialiased, as INTER_AREA) and enlarging (bilinear, as INTER_LINEAR)."""
    rgb = cv2.resize(cv2.imdecode(np.frombuffer(cat_jpeg, np.uint8), cv2.IMREAD_COLOR_RGB), shape[::-1])
    ours = resize_chw(torch.from_numpy(rgb).permute(2, 0, 1), CONFIG).permute(1, 2, 0).numpy()
    theirs = centre_crop_resize(rgb, 224, 0.875)
    difference = np.abs(ours.astype(int) - theirs)
    assert ours.shape == theirs.shape == (224, 224, 3)
    assert difference.mean() < 1.5
    assert np.percentile(difference, 99) <= 8


@pytest.mark.parametrize("orientation", [1, 3, 6, 7])
@pytest.mark.parametrize("size", [(224, 224), (260, 200), (200, 300)], ids=str)
@pytest.mark.parametrize("resize", ["crop", "stretch", "letterbox"])
def test_every_resize_mode_is_opencvs_within_rounding(resize: Resize, size: tuple[int, int], orientation: int) -> None:
    """Crop, stretch and letterbox at square and non-square sizes, with quarter turns: the device's
    input is the CPU path's (the same plan, resize, orientation and grey bands) within rounding."""
    rgb = cv2.resize(skdata.chelsea(), (1200, 900), interpolation=cv2.INTER_CUBIC)
    config = PreprocessConfig(*size, resize=resize)
    ours = resize_chw(torch.from_numpy(rgb).permute(2, 0, 1), config, orientation).permute(1, 2, 0).numpy()
    plan = config.plan(900, 1200, orientation)
    theirs = orient(resize_region(rgb, plan), orientation)
    if resize == "letterbox":
        canvas = np.full((*size, 3), 114, np.uint8)
        canvas[plan.top : plan.top + theirs.shape[0], plan.left : plan.left + theirs.shape[1]] = theirs
        theirs = canvas
    assert ours.shape == theirs.shape == (*size, 3)
    difference = np.abs(ours.astype(int) - theirs)
    assert difference.mean() < 1.5
    assert np.percentile(difference, 99) <= 8


@pytest.mark.parametrize("resize", ["crop", "stretch", "letterbox"])
def test_a_decoders_non_square_inputs_are_prepares(resize: Resize) -> None:
    """Through the decoder (batched, oriented after the resize): a tall input of each mode from
    photos stored with quarter turns is ``prepare``'s, within rounding."""
    config = PreprocessConfig(260, 200, resize)
    coffee = Image.fromarray(skdata.coffee())
    photos = [pil_bytes(coffee, "JPEG", quality=95, exif=_exif(coffee, orientation)) for orientation in (1, 6, 8)]
    for photo, ours in zip(photos, decoder().prepare_many(photos, config), strict=True):
        assert isinstance(ours, np.ndarray)
        assert ours.shape == (260, 200, 3)
        assert np.abs(ours.astype(int) - prepare(photo, config)).mean() < 1.5


def _exif(image: Image.Image, orientation: int) -> bytes:
    exif = image.getexif()
    exif[0x0112] = orientation
    return exif.tobytes()


def test_the_same_photos_get_the_same_answers(models_dir: Path, cat_jpeg: bytes, coffee_jpeg: bytes) -> None:
    profile = get_profile("efficientnet-lite0")
    session = ort.InferenceSession(str(model_path(models_dir, profile)), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    gpu = decoder()
    for photo in (
        cat_jpeg,
        coffee_jpeg,
        encode(cv2.resize(cv2.imdecode(np.frombuffer(cat_jpeg, np.uint8), 1), (1600, 1066))),
    ):
        cpu_scores = session.run(None, {name: prepare(photo, CONFIG)[None]})[0][0]
        gpu_scores = session.run(None, {name: gpu.prepare(photo, CONFIG)[None]})[0][0]
        assert gpu_scores.argmax() == cpu_scores.argmax()
        assert np.abs(gpu_scores - cpu_scores).max() < 0.05


def test_what_the_gpu_decoder_does_not_take_goes_to_opencv(cat_jpeg: bytes) -> None:
    metrics = Metrics()
    png = png_bytes(np.full((40, 60, 3), 90, np.uint8))
    assert np.array_equal(decoder(metrics).prepare(png, CONFIG), prepare(png, CONFIG))
    assert metrics.decode_fallbacks.labels("format")._value.get() == 1

    def refuses(encoded: object, device: torch.device) -> torch.Tensor:
        raise RuntimeError("nvjpeg: unsupported JPEG")

    refused = decoder(metrics, refuses)
    assert np.array_equal(refused.prepare(cat_jpeg, CONFIG), prepare(cat_jpeg, CONFIG))
    assert metrics.decode_fallbacks.labels("refused")._value.get() == 1
    corrupt = cat_jpeg[:600] + bytes(2000)  # a valid header, then nothing a decoder can use
    with pytest.raises(BadImage):
        refused.prepare(corrupt, CONFIG)


def test_a_requests_images_decode_together_and_each_keeps_its_own_outcome(cat_jpeg: bytes, coffee_jpeg: bytes) -> None:
    """One batched call for the JPEGs; a PNG goes to OpenCV, a corrupt JPEG (which fails the batched
    call) gets its own BadImage, and every good image is what ``prepare`` alone gives."""
    metrics = Metrics()
    calls: list[int] = []

    def batched(encoded: list[torch.Tensor], device: torch.device) -> object:
        calls.append(len(encoded))
        return cpu_decode_jpeg(encoded, device)

    gpu = decoder(metrics, batched)
    png = png_bytes(np.full((40, 60, 3), 90, np.uint8))
    photos = [cat_jpeg, png, coffee_jpeg]
    outcomes = gpu.prepare_many(photos, CONFIG)
    assert calls == [2]
    for photo, outcome in zip(photos, outcomes, strict=True):
        assert isinstance(outcome, np.ndarray)
        assert np.array_equal(outcome, gpu.prepare(photo, CONFIG))
    assert metrics.decode_fallbacks.labels("format")._value.get() == 2

    corrupt = cat_jpeg[:600] + bytes(2000)
    outcomes = gpu.prepare_many([coffee_jpeg, corrupt, b"not an image", cat_jpeg], CONFIG)
    assert isinstance(outcomes[1], BadImage)
    assert isinstance(outcomes[2], BadImage)
    assert np.array_equal(outcomes[0], gpu.prepare(coffee_jpeg, CONFIG))  # type: ignore[arg-type]
    assert np.array_equal(outcomes[3], gpu.prepare(cat_jpeg, CONFIG))  # type: ignore[arg-type]


def test_without_a_gpu_decoder_the_setting_fails_at_start() -> None:
    with pytest.raises(RuntimeError, match="GATEWAY_DECODER=nvjpeg needs"):
        NvJpegDecoder("cuda", lambda reason: None)


class NvImageCodecStandIn:
    """Stands in for nvImageCodec's batched decode: per image, HWC uint8 RGB without the EXIF
    rotation (as asked of it), or None where it refuses one (the images ``refuse`` names, and
    anything it cannot decode); it records each call's batch size."""

    def __init__(self, refuse: tuple[bytes, ...] = ()) -> None:
        self.refuse = refuse
        self.calls: list[int] = []

    def __call__(self, datas: list[bytes]) -> list[np.ndarray | None]:
        self.calls.append(len(datas))
        flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
        return [None if data in self.refuse else cv2.imdecode(np.frombuffer(data, np.uint8), flags) for data in datas]


def codec(metrics: Metrics, stand_in: NvImageCodecStandIn) -> NvImageCodecDecoder:
    return NvImageCodecDecoder("cpu", lambda reason: metrics.decode_fallbacks.labels(reason).inc(), decode=stand_in)


def test_nvimagecodec_refuses_per_image_and_only_those_go_to_opencv(cat_jpeg: bytes, coffee_jpeg: bytes) -> None:
    """One batched call for a request's JPEGs; the one it refuses, and the PNG, are decoded by
    OpenCV (exactly ``prepare``'s answer) and counted; the others are its own, within rounding of
    ``prepare``'s; a corrupt JPEG (refused, then OpenCV's) is a bad image of its own."""
    metrics = Metrics()
    stand_in = NvImageCodecStandIn(refuse=(coffee_jpeg,))
    gpu = codec(metrics, stand_in)
    png = png_bytes(np.full((40, 60, 3), 90, np.uint8))
    corrupt = cat_jpeg[:3000]  # its header is whole; the rest is cut off
    outcomes = gpu.prepare_many([cat_jpeg, coffee_jpeg, png, corrupt], CONFIG)
    assert stand_in.calls == [3]  # the three JPEGs together; nothing retried
    assert np.array_equal(outcomes[1], prepare(coffee_jpeg, CONFIG))  # type: ignore[arg-type]
    assert np.array_equal(outcomes[2], prepare(png, CONFIG))  # type: ignore[arg-type]
    assert isinstance(outcomes[3], BadImage)
    cat = outcomes[0]
    assert isinstance(cat, np.ndarray)
    assert cat.shape == (224, 224, 3)
    assert np.abs(cat.astype(int) - prepare(cat_jpeg, CONFIG)).mean() < 1.5
    assert metrics.decode_fallbacks.labels("refused")._value.get() == 2  # coffee, and the corrupt one
    assert metrics.decode_fallbacks.labels("format")._value.get() == 1


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_nvimagecodec_squares_are_oriented_as_opencvs(orientation: int) -> None:
    """nvImageCodec is asked not to rotate: the square is oriented after the crop, giving the
    upright picture ``prepare`` gives."""
    base = np.zeros((200, 300, 3), np.uint8)
    base[:100, :150] = (255, 0, 0)  # a red quadrant top-left marks the orientation
    base[100:, :, 2] = 200
    stored = Image.fromarray(base)
    exif = stored.getexif()
    exif[0x0112] = orientation
    encoded = pil_bytes(stored, "JPEG", exif=exif.tobytes(), quality=95)
    ours = codec(Metrics(), NvImageCodecStandIn()).prepare(encoded, CONFIG)
    assert np.abs(ours.astype(int) - prepare(encoded, CONFIG)).mean() < 2


def test_without_nvimagecodec_the_setting_fails_at_start() -> None:
    with pytest.raises(RuntimeError, match="GATEWAY_DECODER=nvimagecodec needs"):
        NvImageCodecDecoder("cuda", lambda reason: None)
