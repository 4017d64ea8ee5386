"""The ``torch`` backend: ResNet-50 in PyTorch inside the gateway's process, on a CUDA GPU (the study's (docs/study.md)
"simple" architecture on a GPU), or on the CPU where there is none (what the tests run).

Per batch: the decoded images are copied once, into this thread's ``BatchBuffer``, whose arrays are
page-locked on a GPU; one asynchronous copy moves the uint8 batch to the GPU, where it is laid out
(NHWC to channels-last NCHW is a no-op view), converted and normalised; the model runs in fp16 with
its BatchNorms folded into the convolutions; the probabilities come back as float32. Each backend
thread has its own CUDA stream, so one batch's copies overlap another's compute.

Batch sizes are rounded up to a few buckets (powers of two up to ``max_batch_size``), each warmed up
on every backend thread before the backend says it is ready, so cuDNN picks its algorithms before
the first request and never in the middle of serving. The padding rows hold stale data and their
scores are dropped.

On a GPU each bucket's forward pass (layout, normalisation, the model, softmax) is then captured as a
CUDA graph per thread (``cuda_graphs``): a batch is one copy in, one graph launch, one copy out,
instead of a launch per layer from Python. At small batches the launches, not the GPU, set the
pace: on an H100, batch 8 took 4.4 ms eager and 1.5 ms as a graph (p50, one batch in flight), and
several worker processes share the GPU on small batches. A thread's
graphs share one memory pool: they never run at once, and each keeps its own output alive. A capture
that fails leaves that thread on the eager path, said in ``detail`` and the log.

With ``compile`` (``GATEWAY_TORCH_COMPILE``), the forward pass (layout, normalisation, the model,
softmax) is compiled by ``torch.compile`` (Inductor, weights frozen into the graph as constants:
fused kernels instead of one per layer), one graph per bucket, each compiled during the warm-up;
the CUDA graphs above then capture the compiled pass. ``max-autotune`` also times the kernels'
configurations while compiling (minutes per bucket on a GPU). Its answers are the eager pass's
within float tolerance (tests on the CPU); what it gains is measured on a GPU
(``loadtests.gpu_figures``).

A backend thread waits for its batch on a blocking CUDA event (``sync="blocking"``): it sleeps
until the GPU is done. CUDA's default wait, with fewer contexts than cores, spins a core at 100 %
for the whole batch; with several worker processes time-slicing one GPU, those spinning threads
took the cores that decoding needed (``sync="spin"`` keeps CUDA's default, for comparison).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.backends.base import BatchBuffer, Images
from service.backends.inprocess import InProcessBackend
from service.models import resnet, torch_resnet

logger = logging.getLogger(__name__)

_COMPILE_LOCK = threading.Lock()


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
        cuda_graphs: bool = True,
        sync: str = "blocking",
        compile: str = "off",
        bucket_sizes: Sequence[int] | None = None,
    ) -> None:
        """``bucket_sizes``: the batch shapes to run (default ``buckets(max_batch_size)``; a
        measurement of some batch sizes alone need not compile or capture the others)."""
        super().__init__(weights or Path("resnet50 with random weights"), max_concurrency=max_concurrency)
        self._weights = weights
        self._device = torch.device(device)
        cuda = self._device.type == "cuda"
        self._dtype = torch.float16 if cuda and precision == "fp16" else torch.float32
        self._image_size = image_size
        self._buckets = sorted(set(bucket_sizes)) if bucket_sizes else buckets(max_batch_size)
        self._cudnn_benchmark = cudnn_benchmark
        self._cuda_graphs = cuda_graphs and cuda
        self._graph_failures: list[str] = []
        self._sync = sync
        self._compile = compile
        self._compiled: Any = None
        """The compiled forward pass (``compile``), else None: eager."""
        self._buffer = BatchBuffer(self._host_array)
        self._streams = threading.local()
        self._model: torch_resnet.ResNet50 | None = None
        self.random_weights = weights is None

    def _host_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """The staging arrays: page-locked on a GPU, so the copy to it is asynchronous."""
        element = torch.from_numpy(np.empty(0, dtype)).dtype
        array: np.ndarray = torch.empty(shape, dtype=element, pin_memory=self._device.type == "cuda").numpy()
        return array

    def _load(self) -> None:
        if (problem := cuda_problem(str(self._device))) is not None:
            raise RuntimeError(f"{problem} (GATEWAY_TORCH_DEVICE=cpu runs on the CPU)")
        model, self.random_weights = torch_resnet.load(self._weights)
        torch_resnet.fold_batchnorms(model)
        self._model = model.to(device=self._device, dtype=self._dtype, memory_format=torch.channels_last)  # type: ignore[call-overload]
        torch.backends.cudnn.benchmark = self._cudnn_benchmark  # searched per bucket and thread at warm-up
        shape = (1, 3, 1, 1)
        self._mean = torch.tensor(resnet.MEAN, device=self._device, dtype=self._dtype).reshape(shape)
        inv_std = 1.0 / torch.tensor(resnet.STD, device=self._device, dtype=torch.float32)
        self._inv_std = inv_std.to(self._dtype).reshape(shape)
        if self._compile != "off":
            from torch._dynamo import config as dynamo_config

            with _COMPILE_LOCK:  # the limit counts the graphs of the one function every instance compiles
                dynamo_config.cache_size_limit += len(self._buckets) + 1
                if hasattr(dynamo_config, "recompile_limit"):
                    dynamo_config.recompile_limit = dynamo_config.cache_size_limit
            mode = "max-autotune-no-cudagraphs" if self._compile == "max-autotune" else "default"
            self._compiled = torch.compile(self._forward_eager, mode=mode, dynamic=False, fullgraph=True)
        where = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else "CPU"
        precision = "fp16" if self._dtype == torch.float16 else "fp32"
        compiled = f", torch.compile ({self._compile})" if self._compiled is not None else ""
        self.detail = f"PyTorch {torch.__version__}, {where}, {precision}{compiled}" + (
            ", RANDOM WEIGHTS (answers are meaningless)" if self.random_weights else ""
        )

    async def start(self) -> None:
        """Load, then warm every bucket on every backend thread: PyTorch keeps cuDNN's chosen
        algorithms per thread, so a thread meeting a batch shape for the first time searches again
        (measured on an H100: about a second per batch, CPU-bound, with the GPU idle)."""
        await super().start()
        if not self._loaded:
            return
        threads = self._executor._max_workers
        barrier, lock = threading.Barrier(threads), threading.Lock()

        def warm() -> None:
            barrier.wait(timeout=600)  # one call per thread: none returns until all have started
            with lock, self._compiling():  # one search at a time, each timed on an otherwise idle GPU
                for size in self._buckets:
                    self._infer_batch(np.zeros((size, self._image_size, self._image_size, 3), np.uint8))
                if self._cuda_graphs:
                    self._capture_graphs()

        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(loop.run_in_executor(self._executor, warm) for _ in range(threads)))
        except Exception as exc:
            self._loaded, self._load_error = False, f"warm-up failed ({type(exc).__name__}; the gateway's log says why)"
            logger.exception("torch backend: warm-up failed")
            return
        if self._cuda_graphs:
            self.detail = (self.detail or "") + (
                f", eager: CUDA graph capture failed ({self._graph_failures[0]})"
                if self._graph_failures
                else ", CUDA graphs"
            )
        if self.random_weights:
            logger.warning("torch backend: ResNet-50 has RANDOM weights, its answers are meaningless (MODEL_WEIGHTS)")

    def _compiling(self) -> AbstractContextManager[object]:
        """While the warm-up compiles: Inductor's freezing on (the weights are constants of the
        graph), for these compiles only, not for the process's others."""
        if self._compiled is None:
            return nullcontext()
        from torch._inductor import config as inductor_config

        return inductor_config.patch(freezing=True)  # type: ignore[no-any-return]

    def _run(self, images: Images) -> np.ndarray:
        count = len(images)
        size = next((b for b in self._buckets if b >= count), None)
        if size is None:  # (a StopIteration here would never reach the awaiting future)
            raise ValueError(f"a batch of {count} images is over max_batch_size ({self._buckets[-1]})")
        return self._infer_batch(self._buffer.assemble(images, rows=size))[:count]

    def _stream(self) -> torch.cuda.Stream | None:
        """This thread's CUDA stream (None on the CPU)."""
        stream: torch.cuda.Stream | None = getattr(self._streams, "stream", None)
        if stream is None and self._device.type == "cuda":
            stream = self._streams.stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        return stream

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """A uint8 NHWC batch on the device to class probabilities on the device (compiled, or eager)."""
        if self._compiled is not None:
            scores: torch.Tensor = self._compiled(x)
            return scores
        return self._forward_eager(x)

    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        assert self._model is not None
        x = x.permute(0, 3, 1, 2).to(self._dtype).sub_(self._mean).mul_(self._inv_std)
        scores: torch.Tensor = self._model(x.contiguous(memory_format=torch.channels_last))
        return scores

    def _capture_graphs(self) -> None:
        """Capture every bucket's forward pass on this thread (after its eager warm-up, so cuDNN's
        algorithms are chosen already); on failure this thread stays eager."""
        stream = self._stream()
        pool = torch.cuda.graph_pool_handle()
        graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        try:
            for size in self._buckets:
                static = self._static_input(size)
                with torch.inference_mode(), torch.cuda.stream(stream):
                    self._forward(static)  # anything left to compile or choose, outside the capture
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"),
                ):
                    out = self._forward(static)
                graphs[size] = (graph, static, out)
        except Exception as exc:  # e.g. an operation that cannot be captured: serve eagerly
            logger.warning("torch backend: CUDA graph capture failed, this thread runs eagerly: %s", exc)
            self._graph_failures.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        self._streams.graphs = graphs

    def _static_input(self, size: int) -> torch.Tensor:
        """A captured graph's input of ``size`` images: an inference tensor, like the warm-up's, so
        the compiled pass's guards hold for it. With the pass run once on the capture stream before
        capturing (PyTorch's recipe: lazy work such as a compile, cuDNN's choice or a kernel's first
        load must not happen inside a capture), nothing is compiled inside it. On an H100 every
        capture of the compiled pass once failed ("a previous error during capture"); the cause was
        not pinned down there, and this is the fix a next device run checks."""
        with torch.inference_mode():
            return torch.zeros((size, self._image_size, self._image_size, 3), dtype=torch.uint8, device=self._device)

    def _infer_batch(self, batch: np.ndarray) -> np.ndarray:
        stream = self._stream()
        graphs = getattr(self._streams, "graphs", None)
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            x = torch.from_numpy(batch)
            captured = graphs.get(len(batch)) if graphs is not None else None
            if captured is not None:
                graph, static, scores = captured
                static.copy_(x, non_blocking=True)
                graph.replay()
            else:
                scores = self._forward(x.to(self._device, non_blocking=True))
            if stream is None:
                cpu: np.ndarray = scores.numpy()
                return cpu
            return self._fetch(scores, stream)

    def _fetch(self, scores: torch.Tensor, stream: torch.cuda.Stream) -> np.ndarray:
        """The scores copied to this thread's page-locked array, waiting for the stream as
        ``sync`` says; after it the batch's staging array is free again. A copy is returned: the
        array is reused by the thread's next batch while the caller still reads this one."""
        local = self._streams
        host: torch.Tensor | None = getattr(local, "scores", None)
        if host is None or host.shape != scores.shape:
            host = local.scores = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
            local.done = torch.cuda.Event(blocking=self._sync == "blocking")  # type: ignore[no-untyped-call]
        host.copy_(scores, non_blocking=True)
        local.done.record(stream)
        local.done.synchronize()
        out: np.ndarray = host.numpy().copy()
        return out

    def _close(self) -> None:
        self._model = None
        self._compiled = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()


def cuda_problem(device: str) -> str | None:
    """Why PyTorch here cannot run on ``device`` (``cuda``, ``cuda:N``), or None (also for ``cpu``)."""
    where = torch.device(device)
    if where.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is visible to PyTorch here"
    count = torch.cuda.device_count()
    if where.index is not None and where.index >= count:
        return f"PyTorch sees {count} CUDA device(s) here, so no {device}"
    return None
