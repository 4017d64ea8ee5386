"""Metrics the operator tunes by, and the Prometheus rules shipped in deploy/prometheus."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from service.backends.fake import FakeBackend
from service.host.gpu import GpuSampler
from service.metrics import Metrics, forget_dead_processes
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

PROMETHEUS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True)


def test_prometheus_config_and_rules_are_valid() -> None:
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    rules = promtool("check", "rules", "rules/gateway.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "26 rules found" in rules.stdout


def test_alerts_fire_on_synthetic_series() -> None:
    """promtool's unit tests: each alert fires when it should and stays quiet when it should."""
    result = promtool("test", "rules", "gateway.yml", cwd=PROMETHEUS / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


async def test_api_exports_the_tuning_metrics(gateway_factory: Callable[..., Settings]) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        for value in range(3):
            r = await client.post(
                "/classify", content=png_bytes(solid_image(value, 16)), headers={"content-type": "image/png"}
            )
            assert r.status_code == 200
        readyz = (await client.get("/readyz")).json()
        text = (await client.get("/metrics")).text
    assert 'gateway_images_classified_total{mode="online",model="efficientnet-lite0",version="1"} 3.0' in text
    assert (
        'gateway_images_classified_total{mode="offline",model="efficientnet-lite0",version="1"} 0.0' in text
    )  # label values pre-created
    assert "gateway_postprocess_duration_seconds_count 3.0" in text
    assert 'gateway_backend_ready{backend="fake",model="efficientnet-lite0",version="1"} 1.0' in text
    assert 'gateway_rejections_total{reason="queue_full"} 0.0' in text
    assert "process_resident_memory_bytes" in text
    assert "process_cpu_seconds_total" in text
    # Prometheus's conventions: a build series, requests in flight, arrivals as a counter, no _created
    assert re.search(r'^gateway_build_info\{python="[\d.]+",version="\d+\.\d+\.\d+"\} 1\.0$', text, re.M)
    assert "gateway_http_requests_in_flight 1.0" in text  # this request, the /metrics one
    assert 'gateway_batcher_arrivals_total{model="efficientnet-lite0",version="1"} 3.0' in text
    assert "gateway_decode_reserved_bytes 0.0" in text
    assert "_created" not in text
    assert "gateway_batcher_arrival_rate" not in text
    assert "gateway_decode_bytes_reserved" not in text
    # no GPU here: no GPU series at all (not zeros), and /readyz says so
    assert "gateway_gpu_" not in text
    assert readyz["checks"]["gpu"].startswith("none visible")


def test_gpu_sampler_exports_each_gpu() -> None:
    """The NVML sampling logic, against a stand-in NVML module (no GPU is reachable from tests)."""
    gpus = {0: (37, 3 * 2**30, 80 * 2**30), 1: (91, 70 * 2**30, 80 * 2**30)}
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=gpus[h][0]),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=gpus[h][1], total=gpus[h][2]),
    )
    registry = CollectorRegistry()
    sampler = GpuSampler(registry, nvml)
    sampler.sample()
    text = generate_latest(registry).decode()
    assert 'gateway_gpu_utilization_ratio{gpu="0"} 0.37' in text
    assert 'gateway_gpu_utilization_ratio{gpu="1"} 0.91' in text
    assert 'gateway_gpu_memory_used_bytes{gpu="1"} 7.516192768e+10' in text  # 70 GiB
    assert 'gateway_gpu_memory_total_bytes{gpu="0"} 8.589934592e+10' in text  # 80 GiB


def test_arrivals_keep_counting_when_a_new_batcher_is_bound() -> None:
    """A reload binds a new batcher whose own count starts again at zero: its arrivals are
    counted from there, after the old batcher's last ones."""
    metrics = Metrics()
    served = metrics.model("m", "1", "fake")
    old = SimpleNamespace(arrived=0, queue_depth=0, inflight_batches=0, target=1, model=None)
    served.bind(old)  # type: ignore[arg-type]
    old.arrived = 5
    served.sample()
    old.arrived = 7  # arrived after the last sample, before the reload
    new = SimpleNamespace(arrived=2, queue_depth=0, inflight_batches=0, target=1, model=None)
    served.bind(new)  # type: ignore[arg-type]
    new.arrived = 3
    served.sample()
    assert metrics.arrivals.labels("m", "1")._value.get() == 10  # 7 + 3


def test_a_dead_workers_live_gauges_leave_the_sum(tmp_path: Path) -> None:
    """Requests in flight (a ``livesum`` gauge) of a worker that died are no longer counted."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (gone.pid, os.getpid()):
        (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    (tmp_path / f"counter_{gone.pid}.db").write_bytes(b"")  # its counts stay: they happened
    forget_dead_processes(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"gauge_livesum_{os.getpid()}.db", f"counter_{gone.pid}.db"]
    )
