"""A real Prometheus (Debian's package) scrapes a running gateway with the shipped scrape config,
ports adjusted, and its HTTP API returns the gateway's series with the expected values."""

from __future__ import annotations

import asyncio
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
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, running_prometheus, solid_image

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"


def shipped_config_for(gateway_port: int, tmp_path: Path) -> Path:
    """deploy/prometheus/prometheus.yml with the gateway job pointed at the test's port, scraping
    every second; the other jobs' targets (Triton, RabbitMQ, workers) are not running here."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    (gateway_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gateway"]
    gateway_job["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
    config["scrape_configs"] = [gateway_job]
    shutil.copytree(PROMETHEUS_DIR / "rules", tmp_path / "rules")
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
