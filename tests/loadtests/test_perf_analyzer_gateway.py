"""NVIDIA's perf_analyzer works against the gateway: it reads each model's metadata and configuration,
sends encoded photos as the ``IMAGE`` BYTES element over gRPC and over HTTP, and reads the
statistics extension, on a real ``gateway serve`` process with two models; and the
``perf_analyzer_gateway`` figure runs end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.harness.http_load import start_gateway, stop_process
from loadtests.harness.perf_analyzer import PA_DIR, bytes_input, perf_analyzer, request_counts
from service.tune.runner import free_port
from tests.loadtests import ROOT, run_figure

pytestmark = pytest.mark.slow

MODELS = ("efficientnet-lite0", "trivial")


@pytest.fixture
def served(models_dir: Path) -> Iterator[tuple[str, str]]:
    """(REST URL, gRPC host:port) of a gateway process serving both models on its embedded backend."""
    assert (PA_DIR / "perf_analyzer").exists(), "scripts/perf-analyzer builds it (scripts/test runs it)"
    grpc_port = free_port()
    proc, url = start_gateway(
        ["--models", ",".join(MODELS), "--backend", "embedded"], models_dir, env={"GATEWAY_GRPC_PORT": str(grpc_port)}
    )
    try:
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        stop_process(proc)


def test_perf_analyzer_measures_two_models_over_grpc_and_http(
    served: tuple[str, str], tmp_path: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """perf_analyzer 2.41 completes a measurement of each model over each protocol (it exits
    non-zero, and the harness raises, on a failed request, a config it cannot use, or statistics
    it cannot read: unequal compute counts abort it), measures a throughput, and the gateway
    counted those requests against that model, none failed."""
    url, grpc = served
    data = bytes_input("IMAGE", [cat_jpeg, coffee_jpeg], tmp_path / "images.json")
    for model in MODELS:
        for protocol, address in (("grpc", grpc), ("http", url.removeprefix("http://"))):
            before = request_counts(url, model)
            point = perf_analyzer(address, model, 1, 2, 500, False, protocol=protocol, input_data=data)
            assert point.rate > 0, (model, protocol, point)
            assert 0 < point.p50_ms <= point.p99_ms, (model, protocol, point)
            counted = request_counts(url, model) - before
            # three stable windows of 500 ms at least were measured, with the warm-up before them
            assert counted.succeeded >= point.rate * 1.5 * 0.5, (model, protocol, point, counted)
            assert counted.failed == 0, (model, protocol, counted)


def test_the_figure_prints_every_row_and_ratio() -> None:
    """A quick run without Triton: both protocols of perf_analyzer and the load generator on
    /classify at each concurrency, each with a throughput, latencies and the gateway's CPU per
    image; the ratios and the goal's verdict; no failed request."""
    out = run_figure("perf_analyzer_gateway", "--quick", "--no-triton", timeout=120)
    rows = re.findall(
        r"^\| (gateway [^|]+) \| (\w+) \| (grpc|http) \| (\d+) \| "
        + r" \| ".join([r"([\d.]+)"] * 4)
        + r" \| - \| ([\d.]+) \|$",
        out,
        re.M,
    )
    assert {(r[0], r[2], r[3]) for r in rows} == {
        (target, protocol, c)
        for c in ("1", "2")
        for target, protocol in (
            ("gateway /v2 infer", "grpc"),
            ("gateway /v2 infer", "http"),
            ("gateway /classify", "http"),
        )
    }, out
    assert all(float(value) > 0 for r in rows for value in r[4:]), out
    assert re.search(r"^\| median \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    assert re.search(r"^goal, gRPC no dearer than HTTP /classify per image \(gateway CPU\): (met|NOT met) ", out, re.M)
    assert "failed requests: 0" in out


def test_the_figure_refuses_hostile_arguments() -> None:
    """Bad arguments stop the figure before it starts a server, naming the argument."""
    for args in (["--concurrency", "0"], ["--concurrency", "1,x"], ["--interval-ms", "nan"], ["--repeat", "-1"]):
        done = subprocess.run(
            [sys.executable, "-m", "loadtests.perf_analyzer_gateway", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert done.returncode == 2, (args, done.stderr)
        assert args[0] in done.stderr, done.stderr
