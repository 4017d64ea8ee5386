"""The Grafana dashboard: generated, valid, and every query names series that really exist:
the gateway's (a running one), Triton's (a real tritonserver) and RabbitMQ's (its Prometheus
plugin); every expression parses in a real Prometheus."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from service.backends.fake import FakeBackend
from service.host.gpu import GpuSampler
from service.settings import Settings
from service.triton.server import LocalTriton
from tests.conftest import png_bytes, running_gateway, running_prometheus, solid_image

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "gateway.json"
RABBITMQ_METRICS = "http://127.0.0.1:15692/metrics"
# Triton exports these only with a GPU (none in CI); names as in Triton's metrics documentation.
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
PROMQL_WORDS = {
    "sum",
    "avg",
    "max",
    "min",
    "count",
    "rate",
    "increase",
    "deriv",
    "by",
    "without",
    "on",
    "and",
    "or",
    "unless",
    "histogram_quantile",
    "e6",
    "le",
}


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    tokens = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {t for t in tokens if t not in PROMQL_WORDS}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_is_current_and_well_formed(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "grafana" / "make_dashboard.py"), str(out)],
        check=True,
        capture_output=True,
    )
    assert out.read_text() == DASHBOARD.read_text(), "run deploy/grafana/make_dashboard.py"
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"]
    assert dashboard["title"]
    assert dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    datasource_uid = "prometheus"  # deploy/grafana/provisioning/datasources/prometheus.yml
    provisioned = (ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert f"uid: {datasource_uid}" in provisioned
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource_uid
            assert panel["targets"], panel["title"]
            assert all(t["expr"] and t["refId"] for t in panel["targets"])


def test_every_series_the_rules_watch_is_on_the_dashboard() -> None:
    """What pages or opens a ticket can be looked at: each series a recording rule or an alert is
    built on (the HTTP and gRPC fronts' alike) is in some panel's query (``up`` aside: the
    targets' state is Prometheus's own page)."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "gateway.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    watched = {name for g in rules["groups"] for r in g["rules"] for name in metric_names(r["expr"])} - recorded
    assert {"gateway_grpc_requests_total", "gateway_grpc_request_duration_seconds_bucket"} <= watched
    shown = {name for expr in dashboard_queries() for name in metric_names(expr)}
    assert watched - shown == {"up"}


FRONTS = {
    "http": ("gateway_http_requests_total", "route, status", "gateway_http_request_duration_seconds", "route"),
    "grpc": ("gateway_grpc_requests_total", "method, code", "gateway_grpc_request_duration_seconds", "method"),
}
"""Each front's answers counter, by what and how it answered, and its latency histogram, by what."""


def test_each_front_has_its_calls_and_latency_panels() -> None:
    """Each front (REST by route, gRPC by method) has a panel of its answers per second by route or
    method and status code, and one of its latency p50 to p99 by route or method; the two fronts'
    panels side by side, in the same rows."""
    panels: list[dict[str, Any]] = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]

    def panel_of(pattern: str) -> dict[str, Any]:
        found = [p for p in panels if any(re.search(pattern, t["expr"]) for t in p["targets"])]
        assert len(found) == 1, (pattern, [p["title"] for p in found])
        return found[0]

    rows: dict[str, set[int]] = {"calls": set(), "latency": set()}
    for counter, by, histogram, each in FRONTS.values():
        calls = panel_of(rf"^sum by \({by}\) \(rate\({counter}\{{")
        latency = [
            panel_of(rf"^histogram_quantile\({q}, sum by \(le, {each}\) \(rate\({histogram}_bucket\{{")
            for q in ("0.5", "0.99")
        ]
        assert latency[0] is latency[1]
        rows["calls"].add(calls["gridPos"]["y"])
        rows["latency"].add(latency[0]["gridPos"]["y"])
    assert all(len(ys) == 1 for ys in rows.values()), rows
    assert rows["calls"] != rows["latency"]


@pytest.mark.triton
@pytest.mark.rabbitmq
async def test_every_query_names_real_series(
    gateway_factory: Callable[..., Settings], triton: LocalTriton, tmp_path: Path
) -> None:
    exported: set[str] = set()
    settings = gateway_factory(backend="fake", batch_policy="adaptive")  # the adaptive panels' series too
    async with running_gateway(settings, FakeBackend()) as gateway:
        await gateway.post("/classify", content=png_bytes(solid_image(1, 16)), headers={"content-type": "image/png"})
        exported |= exported_names((await gateway.get("/metrics")).text)
    fake_nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=1),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=1, total=2),
    )
    registry = CollectorRegistry()
    GpuSampler(registry, fake_nvml).sample()  # the gateway's GPU series exist only with a GPU
    exported |= exported_names(generate_latest(registry).decode())
    async with httpx.AsyncClient() as client:
        triton_metrics = (await client.get(f"http://127.0.0.1:{triton.ports.metrics}/metrics")).text
        rabbitmq_metrics = (await client.get(RABBITMQ_METRICS)).text
    exported |= exported_names(triton_metrics) | exported_names(rabbitmq_metrics)
    assert "nv_inference_queue_duration_us" in exported
    assert "rabbitmq_global_messages_received_total" in exported
    missing = {
        (expr, name)
        for expr in dashboard_queries()
        for name in metric_names(expr)
        if name not in exported and name not in GPU_ONLY
    }
    assert not missing


async def test_every_query_parses_in_prometheus(tmp_path: Path) -> None:
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1m}\nscrape_configs: []\n")
    async with running_prometheus(config, tmp_path / "data") as client:
        for expr in dashboard_queries():
            body = (await client.get("/api/v1/query", params={"query": expr})).json()
            assert body["status"] == "success", (expr, body.get("error"))


@pytest.mark.rabbitmq
def test_rabbitmq_prometheus_plugin_answers() -> None:
    """.ci/run enables rabbitmq_prometheus; without it the query check above cannot run."""
    with urllib.request.urlopen(RABBITMQ_METRICS, timeout=5) as response:
        assert response.status == 200
