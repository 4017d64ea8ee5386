"""A real Prometheus (Debian's package) scrapes a running gateway with the shipped scrape config,
ports adjusted, and its HTTP API returns the gateway's series with the expected values."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtests.harness.otlp_receiver import OTLPReceiver
from service.backends.fake import FakeBackend
from service.errors import BackendError
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, running_prometheus, solid_image

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "gateway.json"


def shipped_config_for(gateway_port: int, tmp_path: Path) -> Path:
    """deploy/prometheus/prometheus.yml with the gateway job pointed at the test's port, scraping and
    evaluating every rule every second; the other jobs' targets (Triton, RabbitMQ, workers) are not
    running here."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (gateway_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gateway"]
    gateway_job["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
    config["scrape_configs"] = [gateway_job]
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
    for rules_file in (tmp_path / "rules").glob("*.yml"):
        rules = yaml.safe_load(rules_file.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        rules_file.write_text(yaml.safe_dump(rules))
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


async def query(client: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    body = (await client.get("/api/v1/query", params={"query": expr})).json()
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


@pytest.mark.slow
async def test_prometheus_scrapes_the_gateway(gateway_factory: Callable[..., Settings], tmp_path: Path) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as gateway:
        port = int(str(gateway.base_url).rsplit(":", 1)[1].rstrip("/"))
        for value in range(7):
            r = await gateway.post(
                "/classify", content=png_bytes(solid_image(value, 16)), headers={"content-type": "image/png"}
            )
            assert r.status_code == 200
        bad = await gateway.post("/classify", content=b"junk", headers={"content-type": "image/png"})
        assert bad.status_code == 400
        async with running_prometheus(shipped_config_for(port, tmp_path), tmp_path / "data") as prom:
            async with asyncio.timeout(60):  # until a scrape has seen all the requests
                while True:
                    got = await query(prom, 'gateway_images_classified_total{job="gateway",mode="online"}')
                    if got and float(got[0]["value"][1]) == 7:
                        break
                    await asyncio.sleep(0.25)
            assert float((await query(prom, 'up{job="gateway"}'))[0]["value"][1]) == 1
            count = await query(
                prom, 'gateway_http_request_duration_seconds_count{route="/classify",status_class="2xx"}'
            )
            assert float(count[0]["value"][1]) == 7
            rejected = await query(prom, 'gateway_rejections_total{reason="bad_image"}')
            assert float(rejected[0]["value"][1]) == 1
            p99 = await query(
                prom,
                "histogram_quantile(0.99, sum by (le) (gateway_http_request_duration_seconds_bucket"
                '{route="/classify",status_class="2xx"}))',
            )
            assert 0 < float(p99[0]["value"][1]) <= 10
            batches = await query(prom, "gateway_batch_size_sum")
            assert float(batches[0]["value"][1]) == 7


@pytest.mark.slow
async def test_prometheus_keeps_the_trace_exemplars(
    gateway_factory: Callable[..., Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With exemplar storage on (as compose runs it), Prometheus scrapes OpenMetrics from the
    gateway and keeps the trace ids of sampled requests on the latency histograms."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    trace_id = "9" * 32
    with OTLPReceiver() as receiver:
        settings = gateway_factory(backend="fake", tracing_endpoint=receiver.endpoint, tracing_sample_ratio=0.0)
        async with running_gateway(settings, FakeBackend()) as gateway:
            port = int(str(gateway.base_url).rsplit(":", 1)[1].rstrip("/"))
            r = await gateway.post(
                "/classify",
                content=png_bytes(solid_image(3, 16)),
                headers={"content-type": "image/png", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
            )
            assert r.status_code == 200
            config = shipped_config_for(port, tmp_path)
            async with running_prometheus(config, tmp_path / "data", "--enable-feature=exemplar-storage") as prom:
                async with asyncio.timeout(60):
                    while True:
                        body = (
                            await prom.get(
                                "/api/v1/query_exemplars",
                                params={
                                    "query": "gateway_http_request_duration_seconds_bucket",
                                    "start": time.time() - 600,
                                    "end": time.time() + 60,
                                },
                            )
                        ).json()
                        assert body["status"] == "success", body
                        found = {e["labels"]["trace_id"] for series in body["data"] for e in series["exemplars"]}
                        if found:
                            break
                        await asyncio.sleep(0.25)
    assert found == {trace_id}


async def _labels(prom: httpx.AsyncClient, expr: str, label: str) -> set[str]:
    return {series["metric"].get(label, "") for series in await query(prom, expr)}


@pytest.mark.slow
async def test_rules_and_dashboard_cover_every_route_and_model(
    gateway_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    """Requests to every classify and infer route of a real gateway, one route failing (its backend
    batch fails), scraped by a real Prometheus with the shipped rules: the latency recording rule
    has a series per route (by template: the model's name is not a label value), the error ratio
    pages on the failing route and on its model version even while /classify is healthy, and the
    dashboard's HTTP panels show each of those routes and none of the probes or /metrics."""
    model = "efficientnet-lite0"
    image = base64.b64encode(png_bytes(solid_image(5, 16))).decode()
    infer = json.dumps({"inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": [image]}]})
    good = {
        "/classify": "/classify",
        f"/v1/models/{model}/classify": "/v1/models/{name}/classify",
        f"/v1/models/{model}/versions/1/classify": "/v1/models/{name}/versions/{version}/classify",
        f"/v2/models/{model}/versions/1/infer": "/v2/models/{name}/versions/{version}/infer",
    }
    failing = "/v2/models/{name}/infer"
    backend = FakeBackend()
    async with running_gateway(gateway_factory(backend="fake"), backend) as gateway:
        port = int(str(gateway.base_url).rsplit(":", 1)[1].rstrip("/"))
        async with running_prometheus(shipped_config_for(port, tmp_path), tmp_path / "data") as prom:
            async with asyncio.timeout(90):  # requests keep coming until the rules have seen them
                while True:
                    for path in good:
                        if "/v2/" in path:
                            r = await gateway.post(path, content=infer, headers={"content-type": "application/json"})
                        else:
                            r = await gateway.post(
                                path, content=png_bytes(solid_image(5, 16)), headers={"content-type": "image/png"}
                            )
                        assert r.status_code == 200, (path, r.text)
                    backend.fail_next = BackendError("the model fell over")
                    r = await gateway.post(
                        f"/v2/models/{model}/infer", content=infer, headers={"content-type": "application/json"}
                    )
                    assert r.status_code == 500, r.text
                    for probe in ("/healthz", "/readyz", "/v2/health/ready", f"/v2/models/{model}/ready"):
                        assert (await gateway.get(probe)).status_code == 200
                    alerts = {
                        (a["labels"]["alertname"], a["labels"].get("route", a["labels"].get("model")))
                        for a in (await prom.get("/api/v1/alerts")).json()["data"]["alerts"]
                    }
                    latency = await _labels(prom, "gateway:request_duration_seconds:p99", "route")
                    if (
                        latency == set(good.values())
                        and {
                            ("GatewayErrorRatioHigh", failing),
                            ("GatewayModelErrorRatioHigh", model),
                        }
                        <= alerts
                    ):
                        break
                    await asyncio.sleep(0.5)
            errors = await query(prom, "gateway:error_ratio:rate5m")
            assert [(e["metric"]["route"], float(e["value"][1])) for e in errors] == [(failing, 1.0)]
            (by_model,) = await query(prom, "gateway:model_error_ratio:rate5m")
            assert by_model["metric"] == {
                "__name__": "gateway:model_error_ratio:rate5m",
                "model": model,
                "version": "1",
            }
            assert 0.1 < float(by_model["value"][1]) < 0.3  # one batch in five fails
            assert ("GatewayErrorRatioHigh", "/classify") not in alerts

            panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
            answers = panels["Answers/s by route and status"]["targets"][0]["expr"]
            assert await _labels(prom, answers, "route") == {*good.values(), failing}
            for target in panels["Request latency by route (2xx)"]["targets"]:
                assert await _labels(prom, target["expr"], "route") == set(good.values())
            share = panels["5xx share by route, failed batches by version"]["targets"]
            assert await _labels(prom, share[0]["expr"], "route") == {failing}
            assert await _labels(prom, share[1]["expr"].replace("$model", ".*"), "model") == {model}
