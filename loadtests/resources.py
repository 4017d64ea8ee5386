"""Per-process resource sampling during a benchmark run (PAPER.md's Table 2): CPU use and resident
memory of each process (client app, gateway, worker, Triton), mean / max / min, and GPU
utilisation and memory through NVML when a GPU is visible."""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    """A process's resident memory."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


@dataclass
class Series:
    values: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.values:
            return {"mean": float("nan"), "max": float("nan"), "min": float("nan")}
        return {"mean": statistics.fmean(self.values), "max": max(self.values), "min": min(self.values)}


class ResourceSampler:
    """Samples every ``interval`` seconds in a thread; CPU is percent of one core over each interval."""

    def __init__(self, processes: dict[str, int], interval: float = 0.25) -> None:
        self.processes = processes
        self.interval = interval
        self.cpu = {name: Series() for name in processes}
        self.rss = {name: Series() for name in processes}
        self.gpu_utilization = Series()
        self.gpu_memory = Series()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._nvml = self._load_nvml()

    @staticmethod
    def _load_nvml() -> object | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            return pynvml if pynvml.nvmlDeviceGetCount() else None
        except Exception:
            return None

    def _run(self) -> None:
        last = {name: (time.monotonic(), cpu_seconds(pid)) for name, pid in self.processes.items()}
        while not self._stop.wait(self.interval):
            for name, pid in self.processes.items():
                try:
                    now, cpu = time.monotonic(), cpu_seconds(pid)
                    rss = rss_bytes(pid)
                except OSError:  # the process ended
                    continue
                then, cpu_then = last[name]
                if now > then:
                    self.cpu[name].values.append(100.0 * (cpu - cpu_then) / (now - then))
                last[name] = (now, cpu)
                self.rss[name].values.append(float(rss))
            if self._nvml is not None:
                nvml = self._nvml
                handle = nvml.nvmlDeviceGetHandleByIndex(0)  # type: ignore[attr-defined]
                self.gpu_utilization.values.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))  # type: ignore[attr-defined]
                self.gpu_memory.values.append(float(nvml.nvmlDeviceGetMemoryInfo(handle).used))  # type: ignore[attr-defined]

    def __enter__(self) -> ResourceSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, dict[str, float]]:
        """{"<process> cpu %": {mean, max, min}, "<process> rss MiB": {...}, "gpu %": ...}"""
        out = {}
        for name in self.processes:
            out[f"{name} cpu %"] = self.cpu[name].summary()
            out[f"{name} rss MiB"] = {k: v / 2**20 for k, v in self.rss[name].summary().items()}
        if self._nvml is not None:
            out["gpu %"] = self.gpu_utilization.summary()
            out["gpu memory MiB"] = {k: v / 2**20 for k, v in self.gpu_memory.summary().items()}
        return out
