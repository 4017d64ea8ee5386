"""The rest of the Open Inference Protocol's REST surface that Triton's clients call: server
metadata, model configuration, statistics, the repository's index, load and unload, with the real
``tritonclient.http`` against a real gateway serving two models; every answer parsed into
``tritonclient``'s protos as the gRPC front does; hostile repository bodies and the paths the
gateway does not serve, answered in the protocol's error shape."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton_http
from fastapi.routing import APIRoute
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from service.http import inference_protocol, inference_shapes
from service.settings import Settings
from tests.conftest import GatewayClient, png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
MB = 1 << 20
ADMIN_KEY = "an-admin-key-for-the-repository-test"
PNG = png_bytes(solid_image(7, 16))


def _models(tmp_path: Path, **extra: str) -> Path:
    """Two models, ``a`` (the default) and ``b``, on the fake backend."""
    path = tmp_path / "models.toml"
    path.write_text(
        "".join(
            f"[models.{name}]\nprofile = 'trivial'\nbackend = 'fake'\nfake_delay = 0.002\n{extra.get(name, '')}\n"
            for name in ("a", "b")
        )
    )
    return path


async def ask(client: GatewayClient, method: str, *args: Any, **kwargs: Any) -> Any:
    """One call of ``tritonclient.http`` (made, used and closed in a thread: it blocks)."""

    def call() -> Any:
        triton = triton_http.InferenceServerClient(str(client.base_url).removeprefix("http://"), network_timeout=30)
        try:
            return getattr(triton, method)(*args, **kwargs)
        finally:
            triton.close()

    return await asyncio.to_thread(call)


async def _infer(client: GatewayClient, model: str, images: list[bytes]) -> triton_http.InferResult:
    tensor = triton_http.InferInput("IMAGE", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_).reshape(-1, 1), binary_data=True)
    return await ask(client, "infer", model, [tensor])


async def test_tritonclient_reads_server_metadata_configuration_and_the_repository_index(
    gateway_factory: MakeSettings, tmp_path: Path
) -> None:
    """What a Triton client reads before it sends anything: the extensions served, each model's
    configuration (a batch of up to ``max_images_per_request`` images, each one TYPE_STRING
    element: what perf_analyzer needs), consistent with its metadata, and every version ready in
    the index; an unknown model or version is the protocol's 404."""
    settings = gateway_factory(models_file=_models(tmp_path, b="max_batch_size = 4\nmax_delay = 0.01"))
    async with running_gateway(settings.model_copy(update={"max_images_per_request": 16})) as client:
        server = await ask(client, "get_server_metadata")
        assert server["name"] == "inference-gateway"
        assert set(server["extensions"]) >= {"classification", "binary_tensor_data", "model_repository", "statistics"}

        config = await ask(client, "get_model_config", "b")
        assert config["name"] == "b"
        assert config["max_batch_size"] == 16
        assert config["input"] == [{"name": "IMAGE", "data_type": "TYPE_STRING", "dims": [1]}]
        assert config["output"] == [{"name": "PROBABILITIES", "data_type": "TYPE_FP32", "dims": [1000]}]
        assert config["platform"] == "inference-gateway/fake"
        assert config["dynamic_batching"] == {
            "max_queue_delay_microseconds": 10_000,
            "default_queue_policy": {"max_queue_size": 256},
            "preferred_batch_size": [4],
        }
        assert config["parameters"]["input_size"] == {"string_value": "224x224"}
        assert config["parameters"]["output"] == {"string_value": "softmax"}
        assert await ask(client, "get_model_config", "b", "1") == config
        metadata = await ask(client, "get_model_metadata", "b")
        # the batch dimension and then the config's dims, as Triton reports a batching model's tensors
        assert metadata["inputs"][0]["shape"] == [-1, *config["input"][0]["dims"]]
        assert metadata["outputs"][0]["shape"] == [-1, *config["output"][0]["dims"]]

        index = await ask(client, "get_model_repository_index")
        assert index == [
            {"name": "a", "version": "1", "state": "READY", "reason": ""},
            {"name": "b", "version": "1", "state": "READY", "reason": ""},
        ]
        for args, words in ((("c",), "no model 'c'"), (("a", "2"), "model 'a' has no version '2'")):
            with pytest.raises(InferenceServerException, match=words) as caught:
                await ask(client, "get_model_config", *args)
            assert caught.value.status() == "404"


def _duration(stats: dict[str, Any], name: str) -> tuple[int, int]:
    duration = stats["inference_stats"][name]
    return duration["count"], duration["ns"]


async def test_statistics_count_every_fronts_requests_and_batches(
    gateway_factory: MakeSettings, tmp_path: Path
) -> None:
    """Inferences by the v2 REST front and by /classify and /v1/models/a/classify all count on
    a's statistics: successes and a failure (an element that is not an image) per request, queue
    and compute per image, executions per batch, with their times; b's stay at zero; a version
    or model not served is the protocol's 404."""
    started_ms = time.time_ns() // 1_000_000
    async with running_gateway(gateway_factory(models_file=_models(tmp_path))) as client:
        before = (await ask(client, "get_inference_statistics", "a"))["model_stats"]
        assert [(s["name"], s["version"], s["inference_count"], s["last_inference"]) for s in before] == [
            ("a", "1", 0, 0)
        ]
        assert _duration(before[0], "success") == (0, 0)

        result = await _infer(client, "a", [PNG, PNG])
        assert result.as_numpy("PROBABILITIES").shape == (2, 1000)
        for path in ("/classify", "/v1/models/a/classify"):
            answer = await client.post(path, content=PNG, headers={"content-type": "image/png"})
            assert answer.status_code == 200, answer.text
        with pytest.raises(InferenceServerException, match="not a recognised image"):
            await _infer(client, "a", [b"not an image"])

        (stats,) = (await ask(client, "get_inference_statistics", "a", "1"))["model_stats"]
        success, fail = _duration(stats, "success"), _duration(stats, "fail")
        assert success[0] == 3
        assert success[1] > 0
        assert fail[0] == 1
        assert fail[1] > 0
        assert stats["inference_count"] == 4  # images
        queue, infer = _duration(stats, "queue"), _duration(stats, "compute_infer")
        assert queue[0] == infer[0] == 4
        assert infer[1] >= 4 * 2_000_000  # each image counts its batch's time (fake_delay 2 ms)
        # perf_analyzer refuses statistics whose three compute counts differ ("must be the same")
        assert _duration(stats, "compute_input")[0] == _duration(stats, "compute_output")[0] == infer[0]
        batches = stats["batch_stats"]
        assert all(
            b["compute_input"]["count"] == b["compute_infer"]["count"] == b["compute_output"]["count"] for b in batches
        )
        assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == 4
        assert stats["execution_count"] == sum(b["compute_infer"]["count"] for b in batches)
        assert started_ms <= stats["last_inference"] <= time.time_ns() // 1_000_000

        every = (await ask(client, "get_inference_statistics"))["model_stats"]
        assert [(s["name"], s["inference_count"]) for s in every] == [("a", 4), ("b", 0)]
        assert _duration(every[1], "success") == _duration(every[1], "fail") == (0, 0)
        for args, words in ((("c",), "no model 'c'"), (("b", "7"), "model 'b' has no version '7'")):
            with pytest.raises(InferenceServerException, match=words) as caught:
                await ask(client, "get_inference_statistics", *args)
            assert caught.value.status() == "404"


async def test_load_and_unload_need_the_admin_key(gateway_factory: MakeSettings, tmp_path: Path) -> None:
    """Under a memory budget, ``load_model`` loads b and ``unload_model`` unloads a with the
    ``X-Admin-Key`` header, as the index then says; without it or with a wrong one, 403 and
    nothing changes; a load with a configuration is refused (the models file declares the model);
    a gateway with no admin key answers 404."""
    models = _models(tmp_path, a=f"memory = {100 * MB}", b=f"memory = {100 * MB}")
    settings = gateway_factory(models_file=models, model_memory_budget=250 * MB, admin_key=ADMIN_KEY)
    admin = {"X-Admin-Key": ADMIN_KEY}
    async with running_gateway(settings) as client:

        async def states() -> dict[str, tuple[str, str]]:
            index = await ask(client, "get_model_repository_index")
            return {entry["name"]: (entry["state"], entry["reason"]) for entry in index}

        assert await states() == {"a": ("READY", ""), "b": ("UNAVAILABLE", "unloaded")}
        for headers in (None, {"X-Admin-Key": "wrong"}):
            for method in ("load_model", "unload_model"):
                with pytest.raises(InferenceServerException, match="X-Admin-Key is missing or wrong") as caught:
                    await ask(client, method, "b" if method == "load_model" else "a", headers=headers)
                assert caught.value.status() == "403"
        assert await states() == {"a": ("READY", ""), "b": ("UNAVAILABLE", "unloaded")}

        await ask(client, "load_model", "b", headers=admin)
        await ask(client, "unload_model", "a", headers=admin)
        assert await states() == {"a": ("UNAVAILABLE", "unloaded"), "b": ("READY", "")}
        ready = await client.post("/v2/repository/index", content=b'{"ready": true}')
        assert ready.json() == [{"name": "b", "version": "1", "state": "READY", "reason": ""}]

        with pytest.raises(InferenceServerException, match=r"parameters \('config'\) are not supported") as caught:
            await ask(client, "load_model", "a", headers=admin, config=json.dumps({"max_batch_size": 8}))
        assert caught.value.status() == "400"
        with pytest.raises(InferenceServerException, match="no model 'c'") as caught:
            await ask(client, "load_model", "c", headers=admin)
        assert caught.value.status() == "404"
        assert await states() == {"a": ("UNAVAILABLE", "unloaded"), "b": ("READY", "")}

    async with running_gateway(gateway_factory(models_file=models)) as client:
        with pytest.raises(InferenceServerException, match="admin routes are off") as caught:
            await ask(client, "unload_model", "a", headers=admin)
        assert caught.value.status() == "404"


async def test_every_answer_parses_into_tritonclients_protos(gateway_factory: MakeSettings, tmp_path: Path) -> None:
    """What the gRPC front does with the builders' dicts: ``ParseDict`` into the gRPC messages,
    strictly (the metadata's REST-only ``parameters`` aside), with statistics that have counted
    something (batch statistics included); and the REST answers are those dicts."""
    async with running_gateway(gateway_factory(models_file=_models(tmp_path))) as client:
        await _infer(client, "a", [PNG, PNG, PNG])
        with pytest.raises(InferenceServerException):
            await _infer(client, "b", [b"not an image"])
        gateway = client.app.state.gateway
        model = gateway.models.get("a")
        versions = list(model.versions.values())

        server = json_format.ParseDict(inference_shapes.server_metadata(), service_pb2.ServerMetadataResponse())
        assert "statistics" in server.extensions
        metadata = json_format.ParseDict(
            inference_shapes.model_metadata(gateway, model, versions),
            service_pb2.ModelMetadataResponse(),
            ignore_unknown_fields=True,
        )
        assert list(metadata.inputs[0].shape) == [-1, 1]
        assert list(metadata.outputs[0].shape) == [-1, 1000]
        config = json_format.ParseDict(
            inference_shapes.model_config(gateway, versions[0]), model_config_pb2.ModelConfig()
        )
        assert config.max_batch_size == gateway.settings.max_images_per_request
        assert config.input[0].data_type == model_config_pb2.TYPE_STRING
        assert list(config.input[0].dims) == [1]
        assert list(config.version_policy.specific.versions) == [1]
        assert config.dynamic_batching.max_queue_delay_microseconds == round(gateway.settings.max_delay * 1e6)
        statistics = json_format.ParseDict(
            inference_shapes.model_statistics(gateway, None, None), service_pb2.ModelStatisticsResponse()
        )
        by_name = {stats.name: stats for stats in statistics.model_stats}
        assert by_name["a"].inference_count == 3
        assert by_name["a"].inference_stats.success.count == 1
        assert by_name["b"].inference_stats.fail.count == 1
        assert sum(b.batch_size * b.compute_infer.count for b in by_name["a"].batch_stats) == 3
        index = service_pb2.RepositoryIndexResponse()
        for entry in inference_shapes.repository_index(gateway, ready_only=False):
            json_format.ParseDict(entry, index.models.add())
        assert [(m.name, m.version, m.state) for m in index.models] == [("a", "1", "READY"), ("b", "1", "READY")]

        answers = {
            "/v2": inference_shapes.server_metadata(),
            "/v2/models/a/config": inference_shapes.model_config(gateway, versions[0]),
            "/v2/models/stats": inference_shapes.model_statistics(gateway, None, None),
        }
        for path, built in answers.items():
            assert (await client.get(path)).json() == built


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"{not json", 400, "repository index request: Expecting property name"),
        (b"[true]", 400, "must be a JSON object, not an array"),
        (b'{"ready": "yes"}', 400, "ready must be true or false, not a string"),
        (b'{"ready": 1}', 400, "ready must be true or false, not a number"),
        (b'{"ready": true, "ready": false}', 400, "duplicate key 'ready'"),
        (b'{"ready": true, "models": []}', 400, "unknown key(s) 'models'; it takes ready"),
        (b'{"ready": NaN}', 400, "NaN is not JSON"),
        (b'{"\\ud800": true}', 400, "lone UTF-16 surrogate"),
        (b'{"ready": true}\xff', 400, "not UTF-8"),
        (b"[" * 5000 + b"]" * 5000, 400, "holds over 64 JSON values"),
        (b'{"ready": [' + b"0," * 100 + b"0]}", 400, "holds over 64 JSON values"),
        (b'{"ready": true, "x": "' + b"y" * 20_000 + b'"}', 413, "a body over 16384 bytes"),
    ],
    ids=[
        "broken",
        "array",
        "string",
        "number",
        "duplicate",
        "unknown-key",
        "nan",
        "surrogate",
        "not-utf8",
        "deep",
        "many-values",
        "large",
    ],
)
async def test_a_hostile_repository_index_body_gets_the_protocols_400(
    gateway_factory: MakeSettings, tmp_path: Path, content: bytes, status: int, words: str
) -> None:
    """The index's optional body is read bounded (bytes, then JSON values before the parse) and
    strictly; every fault is a 4xx in the protocol's shape naming it, and the gateway goes on."""
    async with running_gateway(gateway_factory(models_file=_models(tmp_path))) as client:
        response = await client.post("/v2/repository/index", content=content)
        good = await client.post("/v2/repository/index", content=b'{"ready": true}')
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    assert words in response.json()["error"]
    assert [entry["name"] for entry in good.json()] == ["a", "b"]


@pytest.mark.parametrize(
    ("path", "content", "words"),
    [
        ("unload", b'{"parameters": []}', "parameters must be an object, not an array"),
        ("unload", b'{"parameters": {"unload_dependents": "no"}}', "unload_dependents must be true or false"),
        ("unload", b'{"parameters": {"force": true}}', "unknown key(s) 'force'"),
        ("load", b'{"parameters": {"file:1/model.onnx": "AAAA"}}', "are not supported"),
        ("load", b'{"model": "b"}', "unknown key(s) 'model'; it takes parameters"),
        ("load", b"null", "must be a JSON object, not null"),
    ],
)
async def test_a_hostile_load_or_unload_body_gets_the_protocols_400(
    gateway_factory: MakeSettings, tmp_path: Path, path: str, content: bytes, words: str
) -> None:
    models = _models(tmp_path, a=f"memory = {100 * MB}", b=f"memory = {100 * MB}")
    settings = gateway_factory(models_file=models, model_memory_budget=250 * MB, admin_key=ADMIN_KEY)
    async with running_gateway(settings) as client:
        response = await client.post(
            f"/v2/repository/models/a/{path}", content=content, headers={"X-Admin-Key": ADMIN_KEY}
        )
        index = (await client.post("/v2/repository/index")).json()
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    assert words in response.json()["error"]
    assert index[0] == {"name": "a", "version": "1", "state": "READY", "reason": ""}  # nothing done


@pytest.mark.parametrize(
    ("method", "path", "status", "words"),
    [
        ("GET", "/v2/systemsharedmemory/status", 400, "shared memory (system or CUDA) is not supported"),
        ("POST", "/v2/cudasharedmemory/region/r/register", 400, "shared memory (system or CUDA) is not supported"),
        ("GET", "/v2/trace/setting", 400, "trace settings are not supported"),
        ("POST", "/v2/models/a/trace/setting", 400, "trace settings are not supported"),
        ("GET", "/v2/logging", 400, "log settings are not supported"),
        ("POST", "/v2/models/a/config", 405, "POST '/v2/models/a/config' is not supported: it takes GET"),
        ("GET", "/v2/models/a/versions/1/infer", 405, "it takes POST"),
        ("DELETE", "/v2", 405, "it takes GET"),
        ("GET", "/v2/repository/index", 405, "it takes POST"),
        ("PUT", "/v2/models/a/stats", 405, "it takes GET"),
        ("GET", "/v2/repository/models/a/load", 405, "it takes POST"),
        ("GET", "/v2/models", 404, "no route of the Open Inference Protocol here"),
        ("POST", "/v2/models/a/versions/1/explain", 404, "no route of the Open Inference Protocol here"),
        ("GET", "/v2/" + "x" * 5000, 404, "(a path of 5004 characters)"),
    ],
)
async def test_what_the_gateway_does_not_serve_answers_in_the_protocols_shape(
    gateway_factory: MakeSettings, tmp_path: Path, method: str, path: str, status: int, words: str
) -> None:
    """Shared memory, trace and log settings (400), a method a path does not take (405 with
    Allow) and any other path under /v2 (404): JSON ``{"error": ...}``, never the framework's 404
    page; counted under one route template, not the raw path."""
    async with running_gateway(gateway_factory(models_file=_models(tmp_path))) as client:
        response = await client.request(method, path)
        metrics = (await client.get("/metrics")).text
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert set(response.json()) == {"error"}
    assert words in response.json()["error"]
    if status == 405:
        assert response.headers["allow"] in words
    if path != "/v2":  # counted under the catch-all's template
        assert f'route="{path}"' not in metrics
        assert 'route="/v2/{rest:path}"' in metrics


async def test_tritonclients_shared_memory_calls_are_told_it_is_not_supported(
    gateway_factory: MakeSettings, tmp_path: Path
) -> None:
    async with running_gateway(gateway_factory(models_file=_models(tmp_path))) as client:
        for method, args in (
            ("get_system_shared_memory_status", ()),
            ("unregister_cuda_shared_memory", ()),
            ("get_trace_settings", ()),
            ("get_log_settings", ()),
        ):
            with pytest.raises(InferenceServerException, match="not supported by this gateway") as caught:
                await ask(client, method, *args)
            assert caught.value.status() == "400"


def test_the_alerts_and_dashboard_leave_out_the_protocols_tool_and_admin_routes() -> None:
    """The latency and error-ratio selections (alert rules and dashboard alike) cover the
    inference routes and leave out configuration, statistics and the repository (load and unload
    are slow by nature), as they leave out the probes: each route template, as the metrics label it."""
    root = Path(__file__).resolve().parents[2]
    texts = [(root / "deploy" / "prometheus" / "rules" / "gateway.yml").read_text()]
    texts.append(json.dumps(json.loads((root / "deploy" / "grafana" / "dashboards" / "gateway.json").read_text())))
    selections = {match for text in texts for match in re.findall(r'route!~\\?"([^"\\]+)\\?"', text)}
    assert len(selections) == 1, selections
    left_out = re.compile(selections.pop())  # Prometheus anchors it: fullmatch
    templates = {route.path for route in inference_protocol.router.routes if isinstance(route, APIRoute)}
    inference = {"/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"}
    kept = {"/v2", "/v2/models/{name}", "/v2/models/{name}/versions/{version}", "/v2/{rest:path}", *inference}
    assert {t for t in templates if not left_out.fullmatch(t)} == kept
    assert left_out.fullmatch("/v2/repository/models/{name}/load")
    assert left_out.fullmatch("/v2/models/{name}/versions/{version}/stats")
