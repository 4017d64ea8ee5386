"""What a grid run writes: ``runs.csv`` (one row per run), ``report.md`` (configurations with
mean and standard error, the study's ratios, cost per million images) and PNG plots like the
study's (throughput vs batch size per architecture, a bar chart of configurations, CPU / memory /
GPU per configuration)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from loadtests.harness.clients import Measurement
from loadtests.harness.grid import Config

PROCESSES = ("client", "gateway", "worker", "triton", "broker")
STATS = ("mean", "max", "min")
CONFIG_FIELDS = ("architecture", "client", "protocol", "submission", "batch", "dataset")


@dataclass
class Run:
    config: Config
    repetition: int
    measurement: Measurement
    resources: dict[str, dict[str, float]]
    """``ResourceSampler.report()``: "<process> cpu %", "<process> rss MiB", "gpu %", "gpu memory MiB"."""


def _resource_columns() -> list[tuple[str, str, str]]:
    """(CSV column, ``ResourceSampler.report()`` key, statistic)."""
    series = [
        (f"{p}_{kind}", f"{p} {key}") for p in PROCESSES for kind, key in (("cpu_pct", "cpu %"), ("rss_mib", "rss MiB"))
    ]
    series += [("gpu_util_pct", "gpu %"), ("gpu_mem_mib", "gpu memory MiB")]
    return [(f"{column}_{stat}", key, stat) for column, key in series for stat in STATS]


RESOURCE_COLUMNS = _resource_columns()
COLUMNS = [
    *CONFIG_FIELDS,
    "repetition",
    "in_flight",
    "images",
    "errors",
    "seconds",
    "img_per_s",
    "p50_ms",
    "p99_ms",
    "mean_batch",
    *(column for column, _, _ in RESOURCE_COLUMNS),
]


def csv_row(run: Run) -> dict[str, object]:
    m, c = run.measurement, run.config
    row: dict[str, object] = {field: getattr(c, field) for field in CONFIG_FIELDS}
    row.update(
        repetition=run.repetition,
        in_flight=c.in_flight,
        images=m.images,
        errors=m.errors,
        seconds=round(m.seconds, 4),
        img_per_s=round(m.rate, 3),
        p50_ms=_round(m.percentile_ms(0.5)),
        p99_ms=_round(m.percentile_ms(0.99)),
        mean_batch=_round(m.mean_batch),
    )
    for column, key, stat in RESOURCE_COLUMNS:
        value = run.resources.get(key, {}).get(stat)
        row[column] = _round(value) if value is not None and not math.isnan(value) else None
    return row


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class CsvLog:
    """runs.csv, one flushed row per run as it finishes (a run cut short keeps what it measured)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, COLUMNS)
        self._writer.writeheader()

    def add(self, run: Run) -> None:
        self._writer.writerow(csv_row(run))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Summary:
    config: Config
    rates: list[float]
    p50_ms: float | None
    p99_ms: float | None
    mean_batch: float | None
    errors: int
    resources: dict[str, dict[str, float]]
    """Over the runs: mean of the means, max of the maxima, min of the minima."""

    @property
    def rate(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def standard_error(self) -> float:
        if len(self.rates) < 2:
            return float("nan")
        return statistics.stdev(self.rates) / math.sqrt(len(self.rates))

    def cost_per_million(self, price_per_hour: float) -> float:
        """Dollars per million images on a machine rented at ``price_per_hour``."""
        return price_per_hour / 3600 / self.rate * 1e6

    def cpu(self, process: str) -> float | None:
        value = self.resources.get(f"{process} cpu %", {}).get("mean")
        return value if value is not None and not math.isnan(value) else None

    def peak_rss(self, process: str) -> float | None:
        value = self.resources.get(f"{process} rss MiB", {}).get("max")
        return value if value is not None and not math.isnan(value) else None


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[Run]) -> list[Summary]:
    by_config: dict[Config, list[Run]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(run)
    summaries = []
    for config, group in by_config.items():
        resources: dict[str, dict[str, float]] = {}
        keys = {key for run in group for key in run.resources}
        for key in sorted(keys):
            stats = [run.resources[key] for run in group if key in run.resources]
            means = [s["mean"] for s in stats if not math.isnan(s["mean"])]
            if means:
                resources[key] = {
                    "mean": statistics.fmean(means),
                    "max": max(s["max"] for s in stats if not math.isnan(s["max"])),
                    "min": min(s["min"] for s in stats if not math.isnan(s["min"])),
                }
        summaries.append(
            Summary(
                config,
                [run.measurement.rate for run in group],
                _median(run.measurement.percentile_ms(0.5) for run in group),
                _median(run.measurement.percentile_ms(0.99) for run in group),
                _median(run.measurement.mean_batch for run in group),
                sum(run.measurement.errors for run in group),
                resources,
            )
        )
    return summaries


# --- markdown -------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def results_table(summaries: list[Summary], price_per_hour: float) -> list[str]:
    lines = [
        "| configuration | in flight | img/s (mean ± s.e.) | s.e. % | p50 ms | p99 ms | batch "
        f"| $ per M images at ${price_per_hour:g}/h | CPU % client / gateway / worker / triton "
        "| peak RSS MiB gateway / worker / triton |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in summaries:
        se_pct = 100 * s.standard_error / s.rate if s.rate else float("nan")
        cpu = " / ".join(_fmt(s.cpu(p), 0) for p in ("client", "gateway", "worker", "triton"))
        rss = " / ".join(_fmt(s.peak_rss(p), 0) for p in ("gateway", "worker", "triton"))
        lines.append(
            f"| {s.config.label} | {s.config.in_flight or '-'} | {s.rate:,.1f} ± {_fmt(s.standard_error)} "
            f"| {_fmt(se_pct)} | {_fmt(s.p50_ms)} | {_fmt(s.p99_ms)} | {_fmt(s.mean_batch)} "
            f"| {s.cost_per_million(price_per_hour):,.2f} | {cpu} | {rss} |"
        )
    return lines


Pair = tuple[Summary, Summary]


def _pairs(summaries: list[Summary], match: Callable[[Config, Config], bool]) -> list[Pair]:
    return [(a, b) for a in summaries for b in summaries if a is not b and match(a.config, b.config)]


def _same_except(a: Config, b: Config, **differ: tuple[object, object]) -> bool:
    for name in CONFIG_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        if name in differ:
            if (va, vb) != differ[name]:
                return False
        elif va != vb:
            return False
    return True


def _ratio_lines(title: str, pairs: list[Pair], value: Callable[[Summary], float | None], study: str) -> list[str]:
    lines = [f"### {title}", "", f"Study: {study}", ""]
    if not pairs:
        return [*lines, "(not in this grid)", ""]
    lines += ["| numerator | denominator | ratio |", "|---|---|---:|"]
    for a, b in pairs:
        va, vb = value(a), value(b)
        ratio = va / vb if va is not None and vb else None
        lines.append(f"| {a.config.label} ({_fmt(va)}) | {b.config.label} ({_fmt(vb)}) | {_fmt(ratio, 3)} |")
    return [*lines, ""]


def _best_gateway_vs_perf(summaries: list[Summary]) -> list[Pair]:
    pairs = []
    for ref in summaries:
        if ref.config.client != "perf_analyzer":
            continue
        candidates = [
            s
            for s in summaries
            if s.config.client == "gateway"
            and s.config.architecture == ref.config.architecture
            and s.config.batch == ref.config.batch
            and s.config.submission == "async"
            and s.config.dataset == "files"
        ]
        if candidates:
            pairs.append((max(candidates, key=lambda s: s.rate), ref))
    return pairs


def ratios(summaries: list[Summary]) -> list[str]:
    def rate(s: Summary) -> float:
        return s.rate

    def gateway_rss(s: Summary) -> float | None:
        return s.peak_rss("gateway")

    gateway = [s for s in summaries if s.config.client == "gateway"]
    batch_one = [s for s in gateway if s.config.batch == 1]
    return [
        *_ratio_lines(
            "The gateway against NVIDIA's perf client (same Triton, same batch)",
            _best_gateway_vs_perf(summaries),
            rate,
            "perf client 458 img/s, async gRPC application 410 img/s: 0.895.",
        ),
        *_ratio_lines(
            "Async against sync submission",
            _pairs(gateway, lambda a, b: _same_except(a, b, submission=("async", "sync"))),
            rate,
            "gRPC async near the top, HTTP async near the bottom; sync HTTP slower than the simple architecture.",
        ),
        *_ratio_lines(
            "gRPC against HTTP between gateway and Triton",
            _pairs(gateway, lambda a, b: _same_except(a, b, protocol=("grpc", "http"))),
            rate,
            "gRPC async near the top, HTTP async near the bottom.",
        ),
        *_ratio_lines(
            "Peak gateway memory at batch size 1, async against sync (MiB)",
            _pairs(batch_one, lambda a, b: _same_except(a, b, submission=("async", "sync"))),
            gateway_rss,
            "at batch 1, async gRPC peaked at 4-4.4x the memory of sync.",
        ),
        *_ratio_lines(
            "Distributed against microservice",
            _pairs(summaries, lambda a, b: _same_except(a, b, architecture=("distributed", "microservice"))),
            rate,
            "distributed falls behind microservice beyond batch 10 (s.e. 20-35 % over the network).",
        ),
        *_ratio_lines(
            "Files copied 9 times, and photos in memory, against the files",
            _pairs(gateway, lambda a, b: _same_except(a, b, dataset=("files-x9", "files")))
            + _pairs(gateway, lambda a, b: _same_except(a, b, dataset=("memory", "files"))),
            rate,
            "with 13,500 files the simple architecture was faster still (file-system caching).",
        ),
        *_ratio_lines(
            "Offline (RabbitMQ) against online async HTTP",
            [
                (a, b)
                for a in summaries
                if a.config.client == "offline"
                for b in gateway
                if b.config.submission == "async"
                and b.config.dataset == "files"
                and (b.config.architecture, b.config.batch, b.config.protocol)
                == (a.config.architecture, a.config.batch, a.config.protocol)
            ],
            rate,
            "queue work that can wait, to load the GPU evenly (no figure).",
        ),
    ]


def markdown(summaries: list[Summary], meta: list[tuple[str, str]], price: float, plots: list[str]) -> str:
    lines = ["# Load-test report", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in meta), ""]
    lines += ["## Configurations", "", *results_table(summaries, price), ""]
    lines += ["## The study's ratios, measured here", "", *ratios(summaries)]
    if plots:
        lines += ["## Plots", "", *(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(lines)


# --- plots ----------------------------------------------------------------------------------------


def plot(summaries: list[Summary], out: Path) -> list[str]:
    """The PNG files written into ``out`` (names relative to it)."""
    import matplotlib
    import matplotlib.patches

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    architectures = list(dict.fromkeys(s.config.architecture for s in summaries))

    def line_name(s: Summary) -> str:
        return s.config.series.removeprefix(f"{s.config.architecture} ")

    line_colours = {name: f"C{i % 10}" for i, name in enumerate(sorted({line_name(s) for s in summaries}))}
    fig, axes = plt.subplots(1, len(architectures), figsize=(6 * len(architectures), 4.5), squeeze=False)
    for ax, arch in zip(axes[0], architectures, strict=True):
        series: dict[str, list[Summary]] = {}
        for s in summaries:
            if s.config.architecture == arch and s.config.dataset in ("files", "tensors"):
                series.setdefault(s.config.series, []).append(s)
        for points in series.values():
            points.sort(key=lambda s: s.config.batch)
            name = line_name(points[0])
            ax.errorbar(
                [s.config.batch for s in points],
                [s.rate for s in points],
                yerr=[0 if math.isnan(s.standard_error) else s.standard_error for s in points],
                marker="o",
                capsize=3,
                label=name,
                color=line_colours[name],
            )
        ax.set_xscale("log", base=2)
        ax.set_title(arch)
        ax.set_xlabel("batch size")
        ax.set_ylabel("images / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput against batch size (mean ± standard error)")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_batch.png", dpi=110)
    plt.close(fig)
    written.append("throughput_vs_batch.png")

    ordered = sorted(summaries, key=lambda s: s.rate)
    labels = [s.config.label for s in ordered]
    colours = {a: f"C{i}" for i, a in enumerate(architectures)}
    height = max(3.0, 0.28 * len(ordered) + 1)
    fig, ax = plt.subplots(figsize=(10, height))
    ax.barh(
        labels,
        [s.rate for s in ordered],
        xerr=[0 if math.isnan(s.standard_error) else s.standard_error for s in ordered],
        color=[colours[s.config.architecture] for s in ordered],
        capsize=2,
    )
    handles = [matplotlib.patches.Patch(color=colour, label=arch) for arch, colour in colours.items()]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.set_xlabel("images / s (mean ± standard error)")
    ax.set_title("Configurations")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "configurations.png", dpi=110)
    plt.close(fig)
    written.append("configurations.png")

    has_gpu = any("gpu %" in s.resources for s in ordered)
    panels = 3 if has_gpu else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, height), sharey=True, squeeze=False)
    for panel, (title, value) in enumerate(
        [("CPU % (mean, 100 = one core)", Summary.cpu), ("peak resident memory, MiB", Summary.peak_rss)]
    ):
        ax = axes[0][panel]
        left = [0.0] * len(ordered)
        for i, process in enumerate(PROCESSES):
            widths = [value(s, process) or 0.0 for s in ordered]
            if any(widths):
                ax.barh(labels, widths, left=left, color=f"C{i}", label=process)
                left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    if has_gpu:
        ax = axes[0][2]
        ax.barh(labels, [s.resources.get("gpu %", {}).get("mean", 0.0) for s in ordered], color="C7")
        ax.set_title("GPU utilisation % (mean)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "resources.png", dpi=110)
    plt.close(fig)
    written.append("resources.png")
    return written
