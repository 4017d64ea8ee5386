"""The GPU figures' load generation (``loadtests.gpu_figures``): its wrk script posts what the
gateway accepts, and every image is counted once, refused requests apart. Run here against a real
gateway with the fake backend; the figures themselves need a GPU (``scripts/gpu-figures``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from loadtests.harness.gpu_report import write_report
from loadtests.harness.gpu_runs import GatewaySpec, Run, bodies, gateway_run, read_runs
from loadtests.harness.http_load import start_gateway
from loadtests.harness.photos import sample_photos
from loadtests.harness.wrk import parse

WRK = shutil.which("wrk")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WRK is None, reason="wrk is installed by scripts/test-deps")]


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [data for _, data in sample_photos()]


def _gateway(tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    return start_gateway([], tmp_path / "models", env={"GATEWAY_BACKEND": "fake", "GATEWAY_MODEL": "trivial", **env})


@pytest.mark.parametrize("per_request", [1, 4])
def test_every_image_posted_is_classified_and_counted(tmp_path: Path, photos: list[bytes], per_request: int) -> None:
    proc, url = _gateway(tmp_path)
    try:
        run = gateway_run(url, proc.pid, "t", photos, per_request, 4, 1, WRK, tmp_path, {"client_threads": 1})
    finally:
        proc.terminate()
        proc.wait(30)
    assert run.errors == 0
    assert run.images > 0
    assert run.images % per_request == 0
    assert run.mean_batch is not None
    assert run.mean_batch >= 1
    assert run.server_cpu_cores is not None
    assert run.server_cpu_cores > 0
    assert run.client_cpu_cores is not None
    assert run.p50_ms is not None
    assert run.p99_ms is not None
    assert run.p50_ms <= run.p99_ms
    assert "refused" not in run.config


def test_refused_requests_are_errors_not_images(tmp_path: Path, photos: list[bytes]) -> None:
    proc, url = _gateway(tmp_path, GATEWAY_API_KEYS="a-key-the-client-does-not-send")
    try:
        run = gateway_run(url, proc.pid, "t", photos, 2, 2, 1, WRK, tmp_path, {"client_threads": 1})
    finally:
        proc.terminate()
        proc.wait(30)
    assert run.images == 0
    assert run.errors > 0
    assert set(run.config["refused"]) == {"401"}
    assert run.config["refused"]["401"] * 2 == run.errors


def test_wrk_output_is_parsed() -> None:
    out = """Running 5s test @ http://127.0.0.1:40735
  4 threads and 256 connections
  Latency Distribution
     50%   15.49ms
     75%  153.22ms
     90%  559.32ms
     99%    1.56s
  55260 requests in 5.03s, 16.29MB read
  Non-2xx or 3xx responses: 54442
Requests/sec:  10977.16
"""
    result = parse(out)
    requests, seconds, failed = result.requests, result.seconds, result.failed
    p50, p99 = result.latency_ms[50], result.latency_ms[99]
    assert (requests, failed) == (55260, 54442)
    assert seconds == pytest.approx(5.03)
    assert p50 == pytest.approx(15.49)
    assert p99 == pytest.approx(1560.0)


def test_the_bodies_are_valid_multipart(tmp_path: Path, photos: list[bytes]) -> None:
    import httpx

    paths, ctype = bodies(photos, 3, tmp_path, count=2)
    proc, url = _gateway(tmp_path)
    try:
        answer = httpx.post(f"{url}/classify", content=paths[1].read_bytes(), headers={"content-type": ctype})
    finally:
        proc.terminate()
        proc.wait(30)
    assert answer.status_code == 200, answer.text
    assert [r["filename"] for r in answer.json()["results"]] == ["0.jpg", "1.jpg", "2.jpg"]
    assert os.path.getsize(paths[0]) > sum(len(p) for p in photos[:3])


def test_gateway_specs_name_what_differs_from_the_default() -> None:
    assert GatewaySpec.parse("14") == GatewaySpec(14)
    assert GatewaySpec.parse("14").full_plan
    spec = GatewaySpec.parse("4:spin:nvjpeg")
    assert (spec.workers, spec.decoder, spec.mode, spec.sync) == (4, "nvjpeg", "graphs", "spin")
    assert spec.label == ", nvjpeg decode, spin wait"
    assert not spec.full_plan
    hardware = GatewaySpec.parse("8:nvimagecodec:compiled")
    assert (hardware.decoder, hardware.mode, hardware.label) == (
        "nvimagecodec",
        "compiled",
        ", nvimagecodec decode, compiled",
    )
    shared = GatewaySpec.parse("16:shared")
    assert (shared.engine, shared.label, shared.full_plan) == ("shared", ", shared engine", False)
    served = GatewaySpec.parse("16:shared:compiled:adaptive")
    assert (served.policy, served.label) == ("adaptive", ", compiled, shared engine, adaptive batching")
    for bad in ("0", "4:foo", "4:eager:graphs", "4:compiled:eager", "4:shared:per-worker", "4:fixed:adaptive", "x"):
        with pytest.raises(ValueError, match=r"spec|invalid literal"):
            GatewaySpec.parse(bad)


def _runs() -> list[Run]:
    """Runs as a device call records them: two backend modes, a closed-loop gateway run in one of
    them, and a Poisson search whose last run is the generator's ceiling (far above everything)."""

    def measured(run: Run, images: int, **config: object) -> Run:
        run.images, run.seconds, run.p50_ms, run.p99_ms = images, 1.0, 5.0, 9.0
        run.config.update(config)
        return run

    gateway = {"mode": "graphs", "engine": "shared", "gateway": "16 workers, shared engine"}
    gateway |= {"p99_bound_ms": 15.0, "highest_rate_within_p99": 3000.0}
    return [
        measured(Run("backend", "torch graphs b256 x4", 256, 4), 10_000, mode="graphs"),
        measured(Run("backend", "torch compiled b256 x4", 256, 4), 20_000, mode="compiled"),
        measured(Run("gateway", "16 workers, 1/request, shared engine", 1, 1024), 8_000, mode="graphs"),
        measured(
            Run("poisson", "16 workers, Poisson 3,000/s", 1, 1024),
            3_000,
            **gateway,
            ceiling=False,
            offered_rate=3000.0,
            p90_ms=7.0,
        ),
        measured(Run("poisson", "16 workers, ceiling", 1, 1024), 250_000, **gateway, ceiling=True, offered_rate=0.0),
    ]


def test_the_report_heads_with_the_gateway_against_its_own_mode_and_never_the_ceiling(tmp_path: Path) -> None:
    runs = _runs()
    write_report(tmp_path, {"gpu": "test"}, runs, "python -m loadtests.gpu_figures --quick", 60.0, 3.0)
    report = (tmp_path / "report.md").read_text()
    headline = report.split("## Headline")[1].split("\n## ")[0]
    assert "**8,000 img/s** (16 workers, 1/request, shared engine)" in headline
    assert "250,000" not in headline.split("generator alone")[0]  # the ceiling is not a gateway figure
    assert "in the gateway's mode (graphs): 10,000 img/s (torch graphs b256 x4); the gateway: **0.800x**\n" in headline
    assert "any mode: 20,000 img/s (torch compiled b256 x4); the gateway: **0.400x**" in headline
    assert "p99 <= 15 ms: **3,000 img/s** (the generator alone: 250,000/s)" in headline
    poisson = report.split("## Poisson arrivals")[1]
    assert "| 16 workers, shared engine | 3,000 | 3,000 | 5.0 | 7.0 | 9.0 |" in poisson
    assert "| 16 workers, shared engine | ceiling (trivial server, closed) | 250,000 |" in poisson
    assert "Poisson" not in report.split("## Gateway end to end")[1].split("## Poisson")[0]
    runs[3].config["highest_rate_within_p99"] = runs[4].config["highest_rate_within_p99"] = 0.0
    write_report(tmp_path, {"gpu": "test"}, runs, "python -m loadtests.gpu_figures --quick", 60.0, 3.0)
    assert (
        "p99 <= 15 ms: **none of the rates tried** (the lowest, 3,000/s: p99 9.0 ms)"
        in (tmp_path / "report.md").read_text()
    )
    assert read_runs(tmp_path / "runs.csv") == runs  # a report can be written again from its runs
