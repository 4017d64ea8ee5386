"""A real Prometheus (Debian's package) scrapes a running gateway with the shipped scrape config,
ports adjusted, and its HTTP API returns the gateway's series with the expected values."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as triton_aio
import yaml
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from loadtests.harness.otlp_receiver import OTLPReceiver
from service.backends.fake import FakeBackend
from service.errors import BackendError, GatewayError
from service.grpc.status import CODES
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, running_prometheus, solid_image

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "gateway.json"
GRPC_METHODS = {m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}


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
            count = await query(prom, 'gateway_http_request_duration_seconds_count{route="/classify",status="200"}')
            assert float(count[0]["value"][1]) == 7
            rejected = await query(prom, 'gateway_rejections_total{reason="bad_image"}')
            assert float(rejected[0]["value"][1]) == 1
            p99 = await query(
                prom,
                "histogram_quantile(0.99, sum by (le) (gateway_http_request_duration_seconds_bucket"
                '{route="/classify",status="200"}))',
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


def _grpc_inputs(image: bytes) -> list[triton_aio.InferInput]:
    tensor = triton_aio.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return [tensor]


async def _grpc_round(client: triton_aio.InferenceServerClient, backend: FakeBackend, model: str) -> None:
    """One of each call a gRPC client makes (tritonclient's asyncio client): an inference that
    succeeds and one whose batch fails (INTERNAL), one for a model that does not exist (NOT_FOUND:
    the client's mistake), a stream of two, the model's metadata, and the probes and tools."""
    image = png_bytes(solid_image(5, 16))
    await client.infer(model, _grpc_inputs(image))
    backend.fail_next = BackendError("the model fell over")
    with pytest.raises(InferenceServerException) as failed:
        await client.infer(model, _grpc_inputs(image))
    assert failed.value.status() == "StatusCode.INTERNAL"
    with pytest.raises(InferenceServerException) as missing:
        await client.infer("missing", _grpc_inputs(image))
    assert missing.value.status() == "StatusCode.NOT_FOUND"

    async def two() -> Any:
        for i in range(2):
            yield {"model_name": model, "inputs": _grpc_inputs(image), "request_id": str(i)}

    answered = [error async for _, error in client.stream_infer(two())]
    assert answered == [None, None]
    assert (await client.get_model_metadata(model)).name == model
    assert await client.is_server_live()
    assert await client.is_server_ready()
    assert await client.is_model_ready(model)
    await client.get_model_config(model)
    await client.get_inference_statistics(model)
    await client.get_model_repository_index()


@pytest.mark.slow
async def test_rules_and_dashboard_cover_every_route_and_model(
    gateway_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    """Requests to every classify and infer route of a real gateway and its gRPC front, one route
    and one gRPC method failing (their backend batches fail), scraped by a real Prometheus with the
    shipped rules: the latency recording rules have a series per route (by template: the model's
    name is not a label value) and per gRPC method, the error ratios page on the failing route, the
    failing method and on its model version even while /classify and the stream are healthy, and
    the dashboard's HTTP and gRPC panels show each of those routes and methods and none of the probes,
    tools or /metrics."""
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
    answered_ok = {"ModelInfer", "ModelStreamInfer.request", "ModelMetadata"}  # gRPC: each a latency
    backend = FakeBackend()
    async with running_gateway(gateway_factory(backend="fake"), backend, grpc=True) as gateway:
        port = int(str(gateway.base_url).rsplit(":", 1)[1].rstrip("/"))
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        try:
            async with running_prometheus(shipped_config_for(port, tmp_path), tmp_path / "data") as prom:
                async with asyncio.timeout(90):  # requests keep coming until the rules have seen them
                    while True:
                        for path in good:
                            if "/v2/" in path:
                                r = await gateway.post(
                                    path, content=infer, headers={"content-type": "application/json"}
                                )
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
                        await _grpc_round(client, backend, model)
                        alerts = {
                            (a["labels"]["alertname"], a["labels"].get("route", a["labels"].get("model")))
                            for a in (await prom.get("/api/v1/alerts")).json()["data"]["alerts"]
                        }
                        grpc_alerts = {
                            (a["labels"]["alertname"], a["labels"].get("method"))
                            for a in (await prom.get("/api/v1/alerts")).json()["data"]["alerts"]
                            if "method" in a["labels"]
                        }
                        latency = await _labels(prom, "gateway:request_duration_seconds:p99", "route")
                        grpc_latency = await _labels(prom, "gateway:grpc_request_duration_seconds:p99", "method")
                        if (
                            latency == set(good.values())
                            and grpc_latency == answered_ok
                            and {("GatewayErrorRatioHigh", failing), ("GatewayModelErrorRatioHigh", model)} <= alerts
                            and ("GatewayGrpcErrorRatioHigh", "ModelInfer") in grpc_alerts
                        ):
                            break
                        await asyncio.sleep(0.5)
                errors = await query(prom, "gateway:error_ratio:rate5m")
                assert [(e["metric"]["route"], float(e["value"][1])) for e in errors] == [(failing, 1.0)]
                (grpc_errors,) = await query(prom, "gateway:grpc_error_ratio:rate5m")
                assert grpc_errors["metric"]["method"] == "ModelInfer"
                assert 0.2 < float(grpc_errors["value"][1]) < 0.5, grpc_errors  # one call in three: not the NOT_FOUND
                assert grpc_alerts == {("GatewayGrpcErrorRatioHigh", "ModelInfer")}
                (by_model,) = await query(prom, "gateway:model_error_ratio:rate5m")
                assert by_model["metric"] == {
                    "__name__": "gateway:model_error_ratio:rate5m",
                    "model": model,
                    "version": "1",
                }
                assert 0.1 < float(by_model["value"][1]) < 0.4, by_model  # two batches in eight or nine fail
                assert ("GatewayErrorRatioHigh", "/classify") not in alerts

                panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
                answers = panels["Answers/s by route and status"]["targets"][0]["expr"]
                assert await _labels(prom, answers, "route") == {*good.values(), failing}
                for target in panels["Request latency by route (2xx)"]["targets"]:
                    assert await _labels(prom, target["expr"], "route") == set(good.values())
                calls = panels["gRPC calls/s by method and code"]["targets"][0]["expr"]
                assert {(s["metric"]["method"], s["metric"]["code"]) for s in await query(prom, calls)} == {
                    ("ModelInfer", "OK"),
                    ("ModelInfer", "INTERNAL"),
                    ("ModelInfer", "NOT_FOUND"),
                    ("ModelStreamInfer", "OK"),
                    ("ModelStreamInfer.request", "OK"),
                    ("ModelMetadata", "OK"),
                }
                for target in panels["gRPC latency by method (OK)"]["targets"]:
                    assert await _labels(prom, target["expr"], "method") == answered_ok
                share = panels["5xx share by route, gRPC failures by method, failed batches by version"]["targets"]
                assert await _labels(prom, share[0]["expr"], "route") == {failing}
                assert await _labels(prom, share[1]["expr"], "method") == {"ModelInfer"}
                assert await _labels(prom, share[2]["expr"].replace("$model", ".*"), "model") == {model}
        finally:
            await client.close()


def _selections(label: str, op: str) -> set[str]:
    """Each ``label op "..."`` matcher's value in the alert rules and the dashboard's queries."""
    texts = [
        (PROMETHEUS_DIR / "rules" / "gateway.yml").read_text(),
        json.dumps(json.loads(DASHBOARD.read_text())),
    ]
    pattern = rf'\b{label}{re.escape(op)}\\?"([^"\\]+)\\?"'
    return {match for text in texts for match in re.findall(pattern, text)}


def _gateway_errors(cls: type[GatewayError] = GatewayError) -> set[type[GatewayError]]:
    return {cls}.union(*(_gateway_errors(sub) for sub in cls.__subclasses__()))


def test_the_grpc_alerts_and_panels_select_the_methods_and_codes_the_http_ones_do() -> None:
    """The gRPC error ratio and latency (rules and dashboard alike) leave out the methods whose
    HTTP routes the HTTP ones leave out (health, configuration, statistics, the repository) and keep
    every other method of the protocol's service, a stream's requests too; the failure codes are
    those of the gateway's 5xx errors, plus grpcio's own UNKNOWN and DATA_LOSS, and none of a
    client's mistakes or limits."""
    (methods,) = _selections("method", "!~")
    left_out = re.compile(methods)  # Prometheus anchors it: fullmatch
    kept = {m for m in GRPC_METHODS | {"ModelStreamInfer.request"} if not left_out.fullmatch(m)}
    assert GRPC_METHODS - kept == {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    }
    assert {"ModelInfer", "ModelStreamInfer", "ModelStreamInfer.request", "ServerMetadata", "ModelMetadata"} <= kept
    # a stream's duration is no latency: only its requests' are
    assert _selections("method", "!=") == {"ModelStreamInfer"}

    (codes,) = _selections("code", "=~")
    failed = set(codes.split("|"))
    errors = _gateway_errors()
    server = {CODES.get(e.status_code, grpc.StatusCode.INTERNAL).name for e in errors if e.status_code >= 500}
    # every 4xx the fronts answer (499: the client left), but 408, a body sent too slowly, which is
    # HTTP's alone (grpcio reads the call itself)
    client = {code.name for status, code in CODES.items() if status < 500 and status != 408}
    assert server == {"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
    assert failed == server | {"UNKNOWN", "DATA_LOSS"}
    assert not failed & client, failed & client
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "CANCELLED"} <= client
