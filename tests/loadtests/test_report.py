from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

from loadtests.harness.clients import Measurement
from loadtests.harness.grid import Config
from loadtests.harness.report import COLUMNS, CsvLog, Run, markdown, plot, summarise

SYNC = Config("microservice", "gateway", "grpc", "sync", 1, "files")
ASYNC = Config("microservice", "gateway", "grpc", "async", 1, "files")
HTTP = Config("microservice", "gateway", "http", "async", 1, "files")
PERF = Config("microservice", "perf_analyzer", "grpc", "async", 1, "tensors")


def run(config: Config, repetition: int, images: int, seconds: float, gateway_rss: float) -> Run:
    resources = {
        "gateway cpu %": {"mean": 50.0 + repetition, "max": 90.0, "min": 10.0 + repetition},
        "gateway rss MiB": {"mean": gateway_rss - 5, "max": gateway_rss, "min": gateway_rss - 10},
    }
    return Run(config, repetition, Measurement(images, seconds, [0.01, 0.02, 0.03, 0.04]), resources)


@pytest.fixture
def runs() -> list[Run]:
    return [
        run(SYNC, 0, 100, 1.0, 120),
        run(SYNC, 1, 100, 1.25, 121),
        run(ASYNC, 0, 100, 0.5, 130),
        run(ASYNC, 1, 100, 0.4, 140),
        run(HTTP, 0, 100, 0.8, 130),
        run(HTTP, 1, 100, 0.8, 130),
        Run(PERF, 0, Measurement(250, 1.0, [], p50_override_ms=5.0, p99_override_ms=9.0), {}),
        Run(PERF, 1, Measurement(250, 1.0, [], p50_override_ms=5.0, p99_override_ms=9.0), {}),
    ]


def test_summaries_give_mean_standard_error_and_resources_over_runs(runs: list[Run]) -> None:
    by_label = {s.config.label: s for s in summarise(runs)}
    sync = by_label[SYNC.label]
    assert sync.rate == pytest.approx(90.0)  # 100 and 80 img/s
    assert sync.standard_error == pytest.approx(statistics.stdev([100, 80]) / math.sqrt(2))
    assert sync.cost_per_million(3.6) == pytest.approx(3.6 / 3600 / 90 * 1e6)
    assert sync.resources["gateway cpu %"] == {"mean": 50.5, "max": 90.0, "min": 10.0}
    assert sync.peak_rss("gateway") == 121
    assert sync.p50_ms == pytest.approx(30.0)
    assert by_label[PERF.label].p99_ms == 9.0
    assert by_label[PERF.label].cpu("gateway") is None


def test_csv_has_one_row_per_run_with_the_measured_numbers(runs: list[Run], tmp_path: Path) -> None:
    log = CsvLog(tmp_path / "runs.csv")
    for r in runs:
        log.add(r)
    log.close()
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS
    assert len(rows) == len(runs)
    assert float(rows[1]["img_per_s"]) == 80.0
    assert rows[1]["gateway_rss_mib_max"] == "121"
    assert rows[1]["triton_cpu_pct_mean"] == ""  # not sampled: empty, not zero


def test_report_states_the_studys_ratios(runs: list[Run], tmp_path: Path) -> None:
    summaries = summarise(runs)
    plots = plot(summaries, tmp_path)
    text = markdown(summaries, [("model", "resnet50")], 3.06, plots)
    assert "| model | resnet50 |" in text
    assert f"| {ASYNC.label} | 4 | 225.0 ± 25.0 |" in text
    # gateway vs perf client: the best async gateway (225) over perf_analyzer (250)
    assert f"| {ASYNC.label} (225.0) | {PERF.label} (250.0) | 0.900 |" in text
    assert f"| {ASYNC.label} (225.0) | {SYNC.label} (90.0) | 2.500 |" in text  # async / sync
    assert f"| {ASYNC.label} (225.0) | {HTTP.label} (125.0) | 1.800 |" in text  # gRPC / HTTP
    assert f"| {ASYNC.label} (140.0) | {SYNC.label} (121.0) | 1.157 |" in text  # peak memory at batch 1
    for name in plots:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name}]({name})" in text
    assert set(plots) == {"throughput_vs_batch.png", "configurations.png", "resources.png"}
