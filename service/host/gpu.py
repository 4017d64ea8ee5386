"""GPU utilisation and memory from NVML (``nvidia-ml-py``), sampled in the background.

Only when NVML loads and sees at least one GPU: otherwise no GPU series are exported at all (an
absent series, not a misleading zero) and ``/readyz`` says that no GPU is visible. In the
gateway's process this reports the GPUs the process can see; with Triton on another host, Triton's
own ``nv_gpu_*`` series on its metrics port are the ones to watch.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

logger = logging.getLogger(__name__)


def load_nvml() -> ModuleType | None:
    try:
        import pynvml  # from nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver, no device: the common case on CPU hosts
        logger.info("gpu: NVML unavailable (%s); no GPU metrics", exc)
        return None
    return pynvml  # type: ignore[no-any-return]


class GpuSampler:
    def __init__(self, registry: CollectorRegistry, nvml: ModuleType | Any, interval: float = 2.0) -> None:
        self.nvml = nvml
        self.interval = interval
        self.count = int(nvml.nvmlDeviceGetCount())
        self.utilization = Gauge(
            "gateway_gpu_utilization_ratio",
            "GPU busy share (0-1), by GPU.",
            ["gpu"],
            registry=registry,
            multiprocess_mode="max",
        )
        self.memory_used = Gauge(
            "gateway_gpu_memory_used_bytes",
            "GPU memory in use, by GPU.",
            ["gpu"],
            registry=registry,
            multiprocess_mode="max",
        )
        self.memory_total = Gauge(
            "gateway_gpu_memory_total_bytes",
            "GPU memory size, by GPU.",
            ["gpu"],
            registry=registry,
            multiprocess_mode="max",
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def sample(self) -> None:
        for i in range(self.count):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
            util = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            self.utilization.labels(str(i)).set(util.gpu / 100.0)
            self.memory_used.labels(str(i)).set(memory.used)
            self.memory_total.labels(str(i)).set(memory.total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:
                logger.warning("gpu: sampling failed: %s", exc)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def start_gpu_sampler(registry: CollectorRegistry) -> GpuSampler | None:
    """A running sampler when a GPU is visible, else None."""
    nvml = load_nvml()
    if nvml is None:
        return None
    sampler = GpuSampler(registry, nvml)
    if sampler.count == 0:
        return None
    sampler.start()
    logger.info("gpu: sampling %d GPU(s)", sampler.count)
    return sampler
