"""The ``torch`` backend: ResNet-50 in PyTorch inside the gateway's process, on a CUDA GPU (PAPER.md's
"simple" architecture on a GPU), or on the CPU where there is none (what the tests run).

Per batch: the decoded images are copied once, into a page-locked host buffer of the batch's shape;
one asynchronous copy moves the uint8 batch to the GPU, where it is laid out (NHWC to channels-last
NCHW is a no-op view), converted and normalised; the model runs in fp16 with its BatchNorms folded
into the convolutions; the probabilities come back as float32. Each backend thread has its own CUDA
stream, so one batch's copies overlap another's compute.

Batch sizes are rounded up to a few buckets (powers of two up to ``max_batch_size``), each warmed up
at load time, so cuDNN picks its algorithms before the first request and never in the middle of
serving. The padding rows hold stale data and their scores are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from service.backends.base import Images
from service.backends.inprocess import InProcessBackend
from service.models import resnet

logger = logging.getLogger(__name__)


def buckets(max_batch_size: int) -> list[int]:
    """Batch shapes the backend runs: 1, 2, 4... and ``max_batch_size`` itself."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


class TorchBackend(InProcessBackend):
    name = "torch"

    def __init__(
        self,
        weights: Path | None,
        *,
        device: str = "cuda",
        precision: str = "fp16",
        image_size: int = 224,
        max_batch_size: int = 64,
        max_concurrency: int = 1,
        cudnn_benchmark: bool = True,
    ) -> None:
        super().__init__(weights or Path("resnet50 with random weights"), max_concurrency=max_concurrency)
        self._weights = weights
        self._device_name = device
        self._precision = precision
        self._image_size = image_size
        self._buckets = buckets(max_batch_size)
        self._cudnn_benchmark = cudnn_benchmark
        self._thread = threading.local()
        self._torch: Any = None
        self._model: Any = None
        self.random_weights = weights is None

    def _load(self) -> None:
        import torch
        from torch.nn.utils.fusion import fuse_conv_bn_eval

        from service.models import torch_resnet

        device = torch.device(self._device_name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible (GATEWAY_TORCH_DEVICE=cpu runs on the CPU)")
        cuda = device.type == "cuda"
        dtype = torch.float16 if cuda and self._precision == "fp16" else torch.float32
        model, self.random_weights = torch_resnet.load(self._weights)
        _fold_batchnorms(model, fuse_conv_bn_eval)
        model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)  # type: ignore[call-overload]
        torch.backends.cudnn.benchmark = self._cudnn_benchmark  # searched per bucket and thread at warm-up
        self._torch, self._model, self._device, self._dtype = torch, model, device, dtype
        shape = (1, 3, 1, 1)
        self._mean = torch.tensor(resnet.MEAN, device=device, dtype=dtype).reshape(shape)
        self._inv_std = (1.0 / torch.tensor(resnet.STD, device=device, dtype=torch.float32)).to(dtype).reshape(shape)
        where = torch.cuda.get_device_name(device) if cuda else "CPU"
        precision = "fp16" if dtype == torch.float16 else "fp32"
        self.detail = f"PyTorch {torch.__version__}, {where}, {precision}" + (
            ", RANDOM WEIGHTS (answers are meaningless)" if self.random_weights else ""
        )

    async def start(self) -> None:
        """Load, then warm every bucket on every backend thread: PyTorch keeps cuDNN's chosen
        algorithms per thread, so a thread meeting a batch shape for the first time searches again
        (measured on an H100: about a second per batch, CPU-bound, with the GPU idle)."""
        await super().start()
        if self._load_error is not None:
            return
        threads = self._executor._max_workers
        barrier, lock = threading.Barrier(threads), threading.Lock()

        def warm() -> None:
            barrier.wait(timeout=600)  # one call per thread: none returns until all have started
            with lock:  # one search at a time, so each times its candidates on an otherwise idle GPU
                for size in self._buckets:
                    self._infer_batch(np.zeros((size, self._image_size, self._image_size, 3), np.uint8))

        loop = asyncio.get_running_loop()
        self._loaded = False  # not ready until warm
        try:
            await asyncio.gather(*(loop.run_in_executor(self._executor, warm) for _ in range(threads)))
        except Exception as exc:
            self._load_error = f"warm-up failed: {exc}"
            logger.exception("torch backend: warm-up failed")
            return
        self._loaded = True
        if self.random_weights:
            logger.warning(
                "torch backend: ResNet-50 has RANDOM weights; its answers are meaningless (set MODEL_WEIGHTS)"
            )

    def _staging(self) -> tuple[Any, Any]:
        """This thread's host buffer (page-locked on a GPU) and CUDA stream, made on first use."""
        local = self._thread
        if getattr(local, "host", None) is None:
            torch = self._torch
            cuda = self._device.type == "cuda"
            side = self._image_size
            local.host = torch.empty((self._buckets[-1], side, side, 3), dtype=torch.uint8, pin_memory=cuda)
            local.view = local.host.numpy()
            local.stream = torch.cuda.Stream(self._device) if cuda else None
        return local.host, local.stream

    def _run(self, images: Images) -> np.ndarray:
        host, _ = self._staging()
        count = len(images)
        np.stack(list(images), out=self._thread.view[:count])  # the one host copy; ValueError on a shape mismatch
        return self._forward(host, count)

    def _infer_batch(self, batch: np.ndarray) -> np.ndarray:
        host, _ = self._staging()
        self._thread.view[: len(batch)] = batch
        return self._forward(host, len(batch))

    def _forward(self, host: Any, count: int) -> np.ndarray:
        torch = self._torch
        size = next(b for b in self._buckets if b >= count)
        _, stream = self._staging()
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            x = host[:size].to(self._device, non_blocking=True)
            x = x.permute(0, 3, 1, 2).to(self._dtype).sub_(self._mean).mul_(self._inv_std)
            scores = self._model(x.contiguous(memory_format=torch.channels_last))[:count]
            out = scores.to("cpu")  # waits for this stream's work, so the host buffer is free again
        result: np.ndarray = out.numpy()
        return result

    def _close(self) -> None:
        self._model = None
        if self._torch is not None and self._device.type == "cuda":
            self._torch.cuda.empty_cache()


def _fold_batchnorms(model: Any, fuse: Any) -> None:
    """Fold each BatchNorm into the convolution before it (inference only): one kernel instead of two."""
    from torch import nn

    from service.models.torch_resnet import Bottleneck, ResNet50

    def fold(owner: Any, conv: str, bn: str) -> None:
        setattr(owner, conv, fuse(getattr(owner, conv), getattr(owner, bn)))
        setattr(owner, bn, nn.Identity())

    assert isinstance(model, ResNet50)
    fold(model, "conv1", "bn1")
    for block in model.modules():
        if isinstance(block, Bottleneck):
            for i in (1, 2, 3):
                fold(block, f"conv{i}", f"bn{i}")
            if block.downsample is not None:
                block.downsample[0] = fuse(block.downsample[0], block.downsample[1])
                block.downsample[1] = nn.Identity()
