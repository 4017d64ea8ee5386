"""Per-process resource sampling during a benchmark run (the study's (docs/study.md) Table 2): CPU use and resident
memory of each process (client app, gateway, worker, Triton), mean / max / min, and GPU
utilisation and memory through NVML when a GPU is visible."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import psutil


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def pinned(cpus: Collection[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs a child (and every thread it starts) on ``cpus`` only; None: anywhere."""
    if cpus is None:
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def pin_process(pid: int, cpus: Collection[int]) -> None:
    """Move a running process, every thread of it, onto ``cpus`` (RabbitMQ's Erlang schedulers)."""
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread.id, set(cpus))


def rss_bytes(pid: int) -> int:
    """A process's resident memory."""
    return int(psutil.Process(pid).memory_info().rss)


def children(pids: set[int]) -> set[int]:
    """``pids`` and all their descendants (that still run)."""
    found = set(pids)
    for pid in pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return found


@dataclass
class Series:
    values: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.values:
            return {"mean": float("nan"), "max": float("nan"), "min": float("nan")}
        return {"mean": statistics.fmean(self.values), "max": max(self.values), "min": min(self.values)}


@functools.cache
def nvml() -> object | None:
    """The initialised pynvml module when a GPU is visible, else None (looked up once)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() else None
    except Exception:
        return None


def gpu_name() -> str:
    lib = nvml()
    if lib is None:
        return "none visible"
    return str(lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(0)))  # type: ignore[attr-defined]


class ResourceSampler:
    """Samples every ``interval`` seconds in a thread; CPU is percent of one core over each interval.

    Processes named in ``with_children`` count with all their descendants (Triton's Python backend
    runs the model in a stub process of its own); ``add`` names one more while sampling runs (a
    client started later)."""

    def __init__(
        self, processes: dict[str, int], interval: float = 0.25, *, with_children: Collection[str] = ()
    ) -> None:
        self.processes = dict(processes)
        self.interval = interval
        self.with_children = set(with_children)
        self._children: dict[str, tuple[float, set[int]]] = {}
        self._lock = threading.Lock()
        self.cpu = {name: Series() for name in processes}
        self.rss = {name: Series() for name in processes}
        self.gpu_utilization = Series()
        self.gpu_memory = Series()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self._nvml = nvml()

    def add(self, name: str, pid: int) -> None:
        with self._lock:
            self.processes[name] = pid
            self.cpu.setdefault(name, Series())
            self.rss.setdefault(name, Series())

    def _usage(self, name: str, pid: int) -> tuple[float, int]:
        """CPU seconds and resident bytes of a process (and its children where asked); ``psutil.Error``
        once it has ended."""
        cpu, rss = cpu_seconds(pid), rss_bytes(pid)
        if name not in self.with_children:
            return cpu, rss
        # walking /proc costs ~2 ms: the children (Triton's stubs) are looked up again every 2 s only
        now = time.monotonic()
        found_at, found = self._children.get(name, (-1e9, set()))
        if now - found_at > 2.0:
            found = children({pid}) - {pid}
            self._children[name] = (now, found)
        for child in found:
            try:
                child_cpu, child_rss = cpu_seconds(child), rss_bytes(child)
            except psutil.Error:  # it ended meanwhile
                continue
            cpu, rss = cpu + child_cpu, rss + child_rss
        return cpu, rss

    def _run(self) -> None:
        """A sample at the start, every ``interval``, and one more when stopped: even a run shorter
        than the interval gets a CPU figure (CPU needs two samples)."""
        last: dict[str, tuple[float, float]] = {}
        stopping = False
        while not stopping:
            self._sample(last)
            stopping = self._stop.wait(self.interval)
        self._sample(last)

    def _sample(self, last: dict[str, tuple[float, float]]) -> None:
        with self._lock:
            processes = dict(self.processes)
        for name, pid in processes.items():
            try:
                now, (cpu, rss) = time.monotonic(), self._usage(name, pid)
            except psutil.Error:  # the process ended
                continue
            self.rss[name].values.append(float(rss))
            if name in last:
                then, cpu_then = last[name]
                if now > then:  # a child that ended takes its CPU time with it: never below 0
                    self.cpu[name].values.append(max(0.0, 100.0 * (cpu - cpu_then) / (now - then)))
            last[name] = (now, cpu)
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
