"""Run the study's (docs/study.md) experiment grid over deployments this command starts, and write a report.

    python -m loadtests --quick --out bench-report          # < 5 minutes on 2 cores
    python -m loadtests --profile full --price-per-hour 3.06 --out bench-report   # GPU hosts

It builds a dataset (224 px photos, the set and the set copied 9 times), then for each
architecture (simple: the gateway's embedded model; microservice: gateway + Triton here;
distributed: Triton in its own network namespace behind a shaped veth pair) and batch size starts
what the configurations need, and runs each configuration ``--repeat`` times, interleaved, sampling
CPU and memory of every process (client, gateway, worker, Triton, RabbitMQ) and the GPU through NVML
where there is one. Writes ``runs.csv``, ``report.md`` and PNG plots to ``--out``. Parts that
cannot run here (no network namespaces, no perf_analyzer, no RabbitMQ, no Triton) are skipped and
the report says why. ``--gateway-url`` measures a gateway that is already running instead;
``--triton-grpc-url`` puts a running Triton (a TensorRT one on a GPU host) in the microservice
architecture instead of the CPU Triton this command would start.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from loadtests.harness import clients, network
from loadtests.harness.dataset import build
from loadtests.harness.deployment import (
    BROKER,
    Triton,
    broker_pid,
    gateway,
    gateway_args,
    gateway_batching,
    local_triton,
    worker,
)
from loadtests.harness.grid import PROFILES, Config, Profile, build_grid
from loadtests.harness.perf_analyzer import PA_DIR, perf_analyzer
from loadtests.harness.report import CsvLog, Run, markdown, plot, summarise
from loadtests.harness.resources import ResourceSampler, gpu_name
from service.backends.embedded import EmbeddedBackend
from service.images.preprocess import PreprocessConfig, prepare
from service.models.profiles import get_profile
from service.models.store import ensure_model
from service.settings import Settings
from service.triton.server import TritonInstall, TritonNotInstalled, default_venv


class ProgressBar:
    """``[#####.....] 12/93 runs, 0:41 left: <label>`` on a terminal; a line per run in logs."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        width = 30
        filled = int(width * self.done / self.total)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs, "
            f"{datetime.timedelta(seconds=round(left))} left: {label}"
        )
        if self.tty:
            print(f"\r\033[K{line}", end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


@dataclass
class Group:
    """What runs at one batch size, for every architecture at once, so that each repetition goes
    through all of them in turn and a drift of the machine's speed does not favour one: gateways,
    workers, the in-process model, and the Triton servers (which live for the whole grid)."""

    tritons: dict[str, Triton]
    gateways: dict[tuple[str, str, str], tuple[int, str]] = field(default_factory=dict)
    """(architecture, protocol, submission) -> (pid, URL); pid 0 for a gateway given by URL."""
    workers: dict[str, tuple[int, Settings]] = field(default_factory=dict)
    """architecture -> (worker pid, the settings its ingest client uses)."""
    backend: EmbeddedBackend | None = None


class Bench:
    def __init__(self, args: argparse.Namespace, profile: Profile, workdir: Path) -> None:
        self.args = args
        self.profile = profile
        self.workdir = workdir
        self.models_dir: Path = args.models_dir
        self.skipped: list[str] = []
        self.network = ""
        self.broker = broker_pid()

    # --- what can run here ------------------------------------------------------------------------

    def runnable(self, grid: list[Config]) -> list[Config]:
        reasons: dict[str, str | None] = {}
        if any(c.architecture == "distributed" for c in grid):
            reasons["distributed"] = (
                "a Triton given by URL stays where it is (--triton-grpc-url): no distributed run"
                if self.args.triton_grpc_url
                else network.check()
            )
        if any(c.architecture in ("microservice", "distributed") for c in grid) and not self.args.triton_grpc_url:
            try:
                TritonInstall.find(default_venv())
            except TritonNotInstalled as exc:
                reasons["microservice"] = reasons["distributed"] = str(exc)
        if any(c.client == "perf_analyzer" for c in grid) and not (PA_DIR / "perf_analyzer").exists():
            reasons["perf_analyzer"] = f"no perf_analyzer in {PA_DIR} (scripts/perf-analyzer builds it)"
        if any(c.client == "offline" for c in grid):
            reasons["offline"] = _broker_unreachable()
        kept = []
        for config in grid:
            why = reasons.get(config.architecture) or reasons.get(config.client)
            if why is None:
                kept.append(config)
        for what, why in reasons.items():
            if why:
                dropped = sum(1 for c in grid if what in (c.architecture, c.client))
                self.skipped.append(f"{what} ({dropped} configurations): {why}")
                print(f"skipping {what}: {why}", file=sys.stderr)
        return kept

    # --- deployments ------------------------------------------------------------------------------

    @contextmanager
    def triton(self, architecture: str) -> Iterator[Triton]:
        shaping = network.Shaping(self.args.rate, self.args.delay_ms, self.args.jitter_ms)
        distributed = architecture == "distributed"
        with local_triton(
            self.profile.model,
            gateway_batching(self.profile.batches),
            self.models_dir,
            self.workdir,
            shaping=shaping if distributed else None,
        ) as triton:
            if distributed:
                self.network = triton.network
            yield triton

    @asynccontextmanager
    async def group(self, batch: int, configs: list[Config], tritons: dict[str, Triton]) -> AsyncIterator[Group]:
        group = Group(tritons)
        model = self.profile.model
        async with AsyncExitStack() as stack:
            # one gateway per architecture, protocol and submission mode: a process's peak memory
            # then belongs to one mode (the study (docs/study.md) compares async and sync peaks)
            keys = dict.fromkeys((c.architecture, c.protocol, c.submission) for c in configs if c.client == "gateway")
            for key in keys:
                architecture, protocol, _ = key
                in_flight = max(c.in_flight for c in configs if (c.architecture, c.protocol, c.submission) == key)
                if architecture == "external":
                    group.gateways[key] = (0, self.args.gateway_url)
                else:
                    args = gateway_args(model, batch, in_flight, tritons.get(architecture), protocol)
                    group.gateways[key] = stack.enter_context(gateway(args, self.models_dir))
                await clients.warm_up(group.gateways[key][1], self.memory_photos[0], batch, in_flight)
            for architecture in dict.fromkeys(c.architecture for c in configs if c.client == "offline"):
                env = {
                    "GATEWAY_MODEL": model,
                    "GATEWAY_MAX_BATCH_SIZE": str(batch),
                    "GATEWAY_MODELS_DIR": str(self.models_dir),
                }
                if architecture in tritons:
                    env |= {"GATEWAY_BACKEND": "triton", "GATEWAY_TRITON_URL": tritons[architecture].grpc_url}
                proc, settings = stack.enter_context(worker(env))
                group.workers[architecture] = (proc.pid, settings)
            if any(c.client == "direct" for c in configs):
                backend = EmbeddedBackend(ensure_model(self.models_dir, get_profile(model)))
                await backend.start()
                stack.push_async_callback(backend.aclose)
                group.backend = backend
            yield group

    # --- one run ----------------------------------------------------------------------------------

    def processes(self, config: Config, group: Group) -> dict[str, int]:
        found: dict[str, int] = {}
        if config.client != "perf_analyzer":  # perf_analyzer joins as the client once started
            found["client"] = os.getpid()
        if config.client == "gateway":
            pid = group.gateways[config.architecture, config.protocol, config.submission][0]
            if pid:
                found["gateway"] = pid
        if config.client == "offline":
            found["worker"] = group.workers[config.architecture][0]
            if self.broker is not None:
                found["broker"] = self.broker
        triton = group.tritons.get(config.architecture)
        if triton is not None and triton.pid is not None:
            found["triton"] = triton.pid
        return found

    async def measure(self, config: Config, repetition: int, group: Group) -> Run:
        images = self.profile.images_for(config)
        offset = repetition * images
        with ResourceSampler(self.processes(config, group), interval=0.1, with_children=["triton"]) as sampler:
            measurement = await self._measure(config, group, images, offset, sampler)
        return Run(config, repetition, measurement, sampler.report())

    async def _measure(
        self, config: Config, group: Group, images: int, offset: int, sampler: ResourceSampler
    ) -> clients.Measurement:
        if config.client == "gateway":
            url = group.gateways[config.architecture, config.protocol, config.submission][1]
            photos = self.photos(config.dataset)
            if config.submission == "sync":
                return await clients.gateway_sync(url, photos, config.batch, images, offset)
            return await clients.gateway_async(url, photos, config.in_flight, images, offset)
        if config.client == "direct":
            assert group.backend is not None
            return await clients.direct(group.backend, self.tensors, config.batch, images)
        if config.client == "offline":
            # distinct paths (the ingest client skips a path it has already sent), the copies included
            count = min(images, len(self.all_files))
            files = [self.all_files[(offset + i) % len(self.all_files)] for i in range(count)]
            return await clients.offline(group.workers[config.architecture][1], files, self.workdir)
        point = await asyncio.to_thread(
            perf_analyzer,
            group.tritons[config.architecture].grpc_url,
            self.profile.model,
            config.batch,
            config.in_flight // config.batch,
            self.profile.perf_interval_ms,
            shm=False,
            on_start=lambda pid: sampler.add("client", pid),
        )
        window = self.profile.perf_interval_ms / 1000
        counted = round(point.rate * window)
        return clients.Measurement(
            counted,
            counted / point.rate,
            [],
            mean_batch=float(config.batch),
            p50_override_ms=point.p50_ms,
            p99_override_ms=point.p99_ms,
        )

    # --- data -------------------------------------------------------------------------------------

    def prepare_data(self, grid: list[Config]) -> None:
        copies = 9 if any(c.dataset == "files-x9" for c in grid) else 1
        dataset = build(
            self.workdir / "dataset",
            count=self.profile.dataset_count,
            copies=copies,
            seed=self.args.seed,
            source=self.args.photos,
        )
        self.files = dataset.originals
        self.all_files = dataset.files
        self.memory_photos = [p.read_bytes() for p in dataset.originals]
        config = PreprocessConfig()
        self.tensors = [prepare(p, config) for p in self.memory_photos[:64]]
        ensure_model(self.models_dir, get_profile(self.profile.model))

    def photos(self, dataset: str) -> clients.Photos:
        if dataset == "memory":
            return self.memory_photos
        return clients.FilePhotos(self.all_files if dataset == "files-x9" else self.files)

    # --- the whole grid ---------------------------------------------------------------------------

    async def run(self, grid: list[Config], log: CsvLog) -> list[Run]:
        runs: list[Run] = []
        progress = ProgressBar(len(grid) * self.profile.repeat)
        with ExitStack() as tritons_stack:
            tritons: dict[str, Triton] = {}
            for architecture in dict.fromkeys(c.architecture for c in grid):
                if architecture == "microservice" and self.args.triton_grpc_url:
                    http = self.args.triton_http_url or ""
                    tritons[architecture] = Triton(self.args.triton_grpc_url, http, None, "given by URL")
                elif architecture in ("microservice", "distributed"):
                    tritons[architecture] = tritons_stack.enter_context(self.triton(architecture))
            for batch, batch_group in itertools.groupby(grid, key=lambda c: c.batch):
                configs = list(batch_group)
                async with self.group(batch, configs, tritons) as group:
                    for repetition in range(self.profile.repeat):
                        for config in configs:
                            run = await self.measure(config, repetition, group)
                            log.add(run)
                            runs.append(run)
                            progress.step(f"{config.label}: {run.measurement.rate:,.1f} img/s")
        return runs


def _broker_unreachable() -> str | None:
    parts = urlsplit(BROKER)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=2):
            return None
    except OSError as exc:
        return f"RabbitMQ is not reachable at {parts.hostname}:{parts.port or 5672} ({exc})"


def _csv(kind: Callable[[str], object]) -> Callable[[str], tuple[object, ...]]:
    def parse(text: str) -> tuple[object, ...]:
        return tuple(kind(part) for part in text.split(",") if part)

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--quick", dest="profile", action="store_const", const="quick", help="same as --profile quick")
    parser.add_argument("--out", type=Path, default=Path("bench-report"))
    grid = parser.add_argument_group("grid (defaults come from the profile)")
    grid.add_argument("--architectures", type=_csv(str), help="simple,microservice,distributed")
    grid.add_argument("--clients", type=_csv(str), help="gateway,offline,direct,perf_analyzer")
    grid.add_argument("--protocols", type=_csv(str), help="grpc,http")
    grid.add_argument("--submissions", type=_csv(str), help="sync,async")
    grid.add_argument("--datasets", type=_csv(str), help="files,files-x9,memory")
    grid.add_argument("--batches", type=_csv(int), help="batch sizes, e.g. 1,2,4,8,16,32,64")
    grid.add_argument("--repeat", type=int, help="runs per configuration (the study: 20)")
    grid.add_argument("--images", type=int, help="photos per run")
    grid.add_argument("--dataset-count", type=int, help="distinct photos (the study: 1,500)")
    grid.add_argument("--model", help="efficientnet-lite0, resnet50, ...")
    parser.add_argument("--photos", type=Path, default=None, help="folder of your own photos for the dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--price-per-hour", type=float, default=3.06, help="machine price in $/h (default: p3.2xlarge)")
    parser.add_argument("--rate", default="5gbit", help="distributed: link rate (tc syntax)")
    parser.add_argument("--delay-ms", type=float, default=0.25, help="distributed: one-way delay")
    parser.add_argument("--jitter-ms", type=float, default=0.05, help="distributed: delay jitter")
    parser.add_argument("--gateway-url", default=None, help="measure this running gateway (architecture external)")
    parser.add_argument(
        "--triton-grpc-url",
        default=None,
        help="microservice: use this running Triton (HOST:PORT, e.g. a TensorRT one on a GPU host) instead of "
        "starting one; it must serve --model under that name with max_batch_size >= the largest batch",
    )
    parser.add_argument("--triton-http-url", default=None, help="its HTTP endpoint (without it: gRPC only)")
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "gateway-bench-models")
    return parser.parse_args(argv)


def profile_from(args: argparse.Namespace) -> Profile:
    profile = PROFILES[args.profile]
    overrides = {
        name: getattr(args, name)
        for name in (
            "architectures",
            "clients",
            "protocols",
            "submissions",
            "datasets",
            "batches",
            "repeat",
            "images",
            "dataset_count",
            "model",
        )
        if getattr(args, name) is not None
    }
    if args.triton_grpc_url and not args.triton_http_url:
        overrides["protocols"] = ("grpc",)
    if args.gateway_url:
        overrides |= {"architectures": ("external",), "clients": ("gateway",)}
    if "batches" in overrides and profile.variant_batches is not None:
        overrides["variant_batches"] = (max(overrides["batches"]),)
    profile = replace(profile, **overrides)
    try:
        profile.check()
    except ValueError as exc:
        raise SystemExit(f"python -m loadtests: {exc}") from None
    return profile


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile = profile_from(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        bench = Bench(args, profile, Path(tmp))
        grid = bench.runnable(build_grid(profile))
        if not grid:
            raise SystemExit("nothing in the grid can run here: " + "; ".join(bench.skipped))
        bench.prepare_data(grid)
        print(
            f"{len(grid)} configurations x {profile.repeat} runs, model {profile.model}, {os.cpu_count()} cores",
            file=sys.stderr,
        )
        log = CsvLog(args.out / "runs.csv")
        try:
            runs = asyncio.run(bench.run(grid, log))
        finally:
            log.close()
    summaries = summarise(runs)
    plots = plot(summaries, args.out)
    meta = [
        ("date", datetime.date.today().isoformat()),
        ("host", f"{os.cpu_count()} cores, {_memory_gib():.0f} GiB, {platform.processor() or platform.machine()}"),
        ("GPU", gpu_name()),
        ("model", profile.model),
        ("profile", f"{profile.name}: batches {', '.join(map(str, profile.batches))}, {profile.repeat} runs each"),
        ("photos per run", f"at least {profile.images}"),
        (
            "dataset",
            f"{profile.dataset_count} photos at 224x224, seed {args.seed}"
            + (f", from {args.photos.name}" if args.photos else ", from scikit-image's sample photos"),
        ),
        ("distributed network", bench.network or "-"),
        ("skipped", "; ".join(bench.skipped) or "nothing"),
        ("wall time", f"{time.monotonic() - started:.0f} s"),
        ("command", "python -m loadtests " + " ".join(sys.argv[1:] if argv is None else argv)),
    ]
    (args.out / "report.md").write_text(markdown(summaries, meta, args.price_per_hour, plots))
    print(f"wrote {args.out / 'report.md'}, {args.out / 'runs.csv'} and {len(plots)} plots", file=sys.stderr)


def _memory_gib() -> float:
    return float(psutil.virtual_memory().total) / 2**30
