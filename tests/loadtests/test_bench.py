"""Smoke test of the experiment grid runner: the quick profile on a tiny grid, over real
deployments (embedded gateway, Triton, Triton in a network namespace, RabbitMQ, perf_analyzer).
It checks the report's structure and that its numbers are positive and agree with each other;
it asserts no speed."""

from __future__ import annotations

import csv
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from loadtests.harness import network
from loadtests.harness.deployment import gateway_batching, local_triton
from loadtests.harness.grid import PROFILES, build_grid
from loadtests.harness.http_load import start_gateway
from loadtests.harness.perf_analyzer import PA_DIR

# serial: perf_analyzer must stabilise its measurements, which the other tests' load on the cores prevents
pytestmark = [pytest.mark.slow, pytest.mark.serial]

ARGS = ["--batches", "1,2", "--repeat", "2", "--images", "8", "--dataset-count", "12", "--protocols", "grpc"]


def run_bench(out: Path, models_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests",
            "--quick",
            *ARGS,
            "--models-dir",
            str(models_dir),
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_runs(out: Path) -> list[dict[str, str]]:
    with (out / "runs.csv").open() as f:
        return list(csv.DictReader(f))


def test_quick_grid_writes_a_consistent_report(tmp_path: Path, models_dir: Path) -> None:
    assert (PA_DIR / "perf_analyzer").exists(), "scripts/perf-analyzer builds it (scripts/test runs it)"
    result = run_bench(tmp_path, models_dir)
    rows = read_runs(tmp_path)
    report = (tmp_path / "report.md").read_text()

    namespaces = network.check() is None
    tiny = replace(PROFILES["quick"], batches=(1, 2), protocols=("grpc",), variant_batches=(2,))
    expected = {c.label for c in build_grid(tiny) if namespaces or c.architecture != "distributed"}
    by_config: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        label = " ".join(
            part
            for part in (
                row["architecture"],
                row["client"],
                row["protocol"],
                row["submission"],
                f"b{row['batch']}",
                row["dataset"],
            )
            if part != "-"
        )
        by_config[label].append(row)
    assert set(by_config) == expected
    assert all(len(group) == 2 for group in by_config.values())  # --repeat 2
    if not namespaces:
        assert "distributed" in report.split("| skipped |")[1].splitlines()[0]

    for row in rows:
        images, seconds, rate = int(row["images"]), float(row["seconds"]), float(row["img_per_s"])
        assert row["errors"] == "0"
        assert min(images, seconds, rate) > 0
        assert rate == pytest.approx(images / seconds, rel=0.01)
        if row["client"] == "gateway":
            assert float(row["gateway_cpu_pct_mean"]) > 0
            assert float(row["gateway_rss_mib_max"]) >= float(row["gateway_rss_mib_min"]) > 0
            assert 1 <= float(row["mean_batch"]) <= int(row["batch"])
            assert float(row["p99_ms"]) >= float(row["p50_ms"]) > 0
        if row["architecture"] in ("microservice", "distributed"):
            assert float(row["triton_rss_mib_max"]) > 0
        if row["client"] == "offline":
            assert float(row["worker_rss_mib_max"]) > 0

    # the table's mean is the mean of the runs in the CSV, and the cost follows from it
    for label, group in by_config.items():
        mean = statistics.fmean(float(r["img_per_s"]) for r in group)
        match = re.search(
            rf"^\| {re.escape(label)} \| [^|]+ \| ([0-9,.]+) ± [^|]+ \|(?:[^|]*\|){{4}} ([0-9,.]+) \|", report, re.M
        )
        assert match, label
        assert float(match.group(1).replace(",", "")) == pytest.approx(mean, abs=0.051)
        assert float(match.group(2).replace(",", "")) == pytest.approx(3.06 / 3600 / mean * 1e6, rel=0.01)

    for section in ("## Configurations", "## The study's ratios, measured here", "## Plots"):
        assert section in report
    assert "The gateway against NVIDIA's perf client" in report
    for name in ("throughput_vs_batch.png", "configurations.png", "resources.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "runs," in result.stderr  # the progress bar


def test_a_running_gateway_given_by_url(tmp_path: Path, models_dir: Path) -> None:
    proc, url = start_gateway(["--backend", "fake"], models_dir)
    try:
        run_bench(tmp_path, models_dir, "--gateway-url", url, "--datasets", "files")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rows = read_runs(tmp_path)
    assert {(r["architecture"], r["client"], r["submission"], r["batch"]) for r in rows} == {
        ("external", "gateway", s, b) for s in ("sync", "async") for b in ("1", "2")
    }
    assert all(float(r["img_per_s"]) > 0 and r["errors"] == "0" for r in rows)
    assert all(r["gateway_cpu_pct_mean"] == "" for r in rows)  # not ours to sample


def test_a_running_triton_given_by_url(tmp_path: Path, models_dir: Path) -> None:
    with local_triton("efficientnet-lite0", gateway_batching((1, 2)), models_dir, tmp_path) as triton:
        run_bench(
            tmp_path / "out",
            models_dir,
            *("--architectures", "microservice,distributed", "--clients", "gateway,perf_analyzer"),
            *("--datasets", "files", "--triton-grpc-url", triton.grpc_url),
        )
    rows = read_runs(tmp_path / "out")
    assert {(r["architecture"], r["client"], r["protocol"]) for r in rows} == {
        ("microservice", "gateway", "grpc"),
        ("microservice", "perf_analyzer", "grpc"),
    }
    assert all(float(r["img_per_s"]) > 0 and r["errors"] == "0" for r in rows)
    assert all(r["triton_cpu_pct_mean"] == "" for r in rows)  # not started here: not sampled
    report = (tmp_path / "out" / "report.md").read_text()
    assert "distributed" in report.split("| skipped |")[1].splitlines()[0]
