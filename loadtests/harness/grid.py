"""The experiment grid of the study (docs/study.md): which configurations a benchmark run measures.

A configuration is one point of the study's factors:

* ``architecture``: ``simple`` (the gateway with its embedded backend: application and framework in
  one process), ``microservice`` (the gateway and Triton on this host), ``distributed`` (Triton in
  its own network namespace behind a shaped link), or ``external`` (a gateway given by URL);
* ``client``: ``gateway`` (HTTP clients posting photos to the gateway), ``offline`` (the ingest
  client -> RabbitMQ -> ``gateway worker``), ``direct`` (the embedded model called in-process on
  tensors: the study's "(1) without files") or ``perf_analyzer`` (NVIDIA's client, tensors straight
  to Triton: the study's reference);
* ``protocol``: how the gateway reaches Triton, ``grpc`` or ``http`` (``-`` where there is no Triton
  in between);
* ``submission``: ``sync`` (one request at a time, each carrying ``batch`` photos: the client
  batches and waits) or ``async`` (``ASYNC_DEPTH`` x ``batch`` single-photo requests in flight: the
  gateway forms the batches);
* ``batch``: the batch size (the gateway's ``--max-batch-size``; perf_analyzer's ``-b``);
* ``dataset``: ``files`` (the client reads each photo from disk as it sends it), ``files-x9`` (the
  same over the set copied 9 times, the study's (docs/study.md) 13,500 files), ``memory`` (photos already in the
  client's memory) or ``tensors`` (decoded tensors, no photos at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Architecture = Literal["simple", "microservice", "distributed", "external"]
Client = Literal["gateway", "offline", "direct", "perf_analyzer"]
Submission = Literal["sync", "async"]
Dataset = Literal["files", "files-x9", "memory", "tensors"]

ARCHITECTURES: tuple[Architecture, ...] = ("simple", "microservice", "distributed")
PROTOCOLS = ("grpc", "http")
SUBMISSIONS: tuple[Submission, ...] = ("sync", "async")
DATASETS: tuple[Dataset, ...] = ("files", "files-x9", "memory")
CLIENTS: tuple[Client, ...] = ("gateway", "offline", "direct", "perf_analyzer")
ASYNC_DEPTH = 4
"""Async clients keep this many batches' worth of single-photo requests in flight."""
PERF_ANALYZER_CONCURRENCY = 2
"""Batches perf_analyzer keeps in flight: the gateway's default --max-inflight-batches."""


@dataclass(frozen=True, order=True)
class Config:
    architecture: Architecture
    client: Client
    protocol: str
    submission: Submission
    batch: int
    dataset: Dataset

    @property
    def label(self) -> str:
        """Short name for tables and plots, e.g. ``microservice gateway grpc async b8 files``."""
        parts: list[str] = [self.architecture, self.client]
        if self.protocol != "-":
            parts.append(self.protocol)
        parts += [self.submission, f"b{self.batch}", self.dataset]
        return " ".join(parts)

    @property
    def series(self) -> str:
        """The configuration without its batch size: one line of the throughput-vs-batch plot."""
        return self.label.replace(f" b{self.batch} ", " ")

    @property
    def in_flight(self) -> int:
        """Photos the client keeps outstanding."""
        if self.client == "perf_analyzer":
            return PERF_ANALYZER_CONCURRENCY * self.batch
        if self.client == "offline":
            return 0  # the ingest client publishes everything; the worker's prefetch bounds it
        return self.batch if self.submission == "sync" else ASYNC_DEPTH * self.batch


@dataclass(frozen=True)
class Profile:
    name: str
    batches: tuple[int, ...]
    repeat: int
    images: int
    """Photos per run (at least ``4 * ASYNC_DEPTH * batch`` are sent)."""
    dataset_count: int
    """Distinct photos in the dataset (the study (docs/study.md): 1,500)."""
    model: str
    perf_interval_ms: int
    variant_batches: tuple[int, ...] | None = None
    """Batch sizes at which the dataset variants (files-x9, memory) and offline run; None: all."""
    architectures: tuple[Architecture, ...] = ARCHITECTURES
    protocols: tuple[str, ...] = PROTOCOLS
    submissions: tuple[Submission, ...] = SUBMISSIONS
    datasets: tuple[Dataset, ...] = DATASETS
    clients: tuple[Client, ...] = CLIENTS

    def check(self) -> None:
        """ValueError naming any factor value this grid does not know."""
        allowed: dict[str, tuple[object, ...]] = {
            "architectures": (*ARCHITECTURES, "external"),
            "clients": CLIENTS,
            "protocols": PROTOCOLS,
            "submissions": SUBMISSIONS,
            "datasets": DATASETS,
        }
        for name, values in allowed.items():
            unknown = [v for v in getattr(self, name) if v not in values]
            if unknown:
                raise ValueError(
                    f"--{name}: unknown {', '.join(map(str, unknown))} (one of {', '.join(map(str, values))})"
                )
        if not self.batches or min(self.batches) < 1:
            raise ValueError("--batches: batch sizes are whole numbers from 1")
        if self.repeat < 1 or self.images < 1 or self.dataset_count < 1:
            raise ValueError("--repeat, --images and --dataset-count must be at least 1")

    def images_for(self, config: Config) -> int:
        """Photos for one run: enough for several rounds of what the client keeps in flight, and
        twice the usual for offline runs, whose fixed cost (queues, first and last message) is larger."""
        floor = 4 * max(config.in_flight, config.batch)
        return max(self.images * (2 if config.client == "offline" else 1), floor)


PROFILES = {
    "quick": Profile(
        "quick",
        batches=(1, 8),
        repeat=5,
        images=64,
        dataset_count=150,
        model="efficientnet-lite0",
        perf_interval_ms=600,
        variant_batches=(8,),
    ),
    "full": Profile(
        "full",
        batches=(1, 2, 4, 8, 16, 32, 64),
        repeat=20,
        images=512,
        dataset_count=1500,
        model="resnet50",
        perf_interval_ms=3000,
    ),
}


def build_grid(profile: Profile) -> list[Config]:
    """Every configuration of the profile, by batch size (the runner starts gateways per batch size
    and goes through every architecture in each repetition)."""
    configs: list[Config] = []
    for batch in profile.batches:
        for arch in profile.architectures:
            variants = profile.variant_batches is None or batch in profile.variant_batches
            protocols = ("-",) if arch in ("simple", "external") else profile.protocols
            if "gateway" in profile.clients:
                for protocol in protocols:
                    for submission in profile.submissions:
                        for dataset in profile.datasets:
                            if dataset == "files" or (variants and submission == "async"):
                                configs.append(Config(arch, "gateway", protocol, submission, batch, dataset))
            if "direct" in profile.clients and arch == "simple":
                configs.append(Config(arch, "direct", "-", "sync", batch, "tensors"))
            if "perf_analyzer" in profile.clients and arch in ("microservice", "distributed"):
                configs.append(Config(arch, "perf_analyzer", "grpc", "async", batch, "tensors"))
            if "offline" in profile.clients and variants and arch in ("simple", "microservice"):
                configs.append(Config(arch, "offline", protocols[0], "async", batch, "files"))
    return configs
