"""The Open Inference Protocol over gRPC, against a real gateway, with the real ``tritonclient.grpc``
clients (sync, asyncio, streaming): the same models, answers, limits and errors as the REST front."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.settings import Settings
from tests.conftest import CAT_CLASSES, running_gateway

MakeSettings = Callable[..., Settings]
ESPRESSO = 967
TWO_MODELS = "efficientnet-lite0,trivial"


def _inputs(images: list[bytes]) -> list[triton_grpc.InferInput]:
    tensor = triton_grpc.InferInput("IMAGE", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=np.object_))
    return [tensor]


def _sync_infer(url: str, model: str, images: list[bytes], k: int = 0, **kwargs: Any) -> Any:
    client = triton_grpc.InferenceServerClient(url)
    try:
        output = triton_grpc.InferRequestedOutput("PROBABILITIES", class_count=k)
        return client.infer(model, _inputs(images), outputs=[output], **kwargs)
    finally:
        client.close()


async def test_the_sync_client_classifies_real_photos_on_two_models(
    gateway_factory: MakeSettings, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    async with running_gateway(gateway_factory(models=TWO_MODELS), grpc=True) as gateway:

        def calls() -> tuple[Any, ...]:
            client = triton_grpc.InferenceServerClient(gateway.grpc_url)
            try:
                return (
                    client.is_server_live(),
                    client.is_server_ready(),
                    client.is_model_ready("efficientnet-lite0"),
                    client.is_model_ready("trivial"),
                    client.get_server_metadata(),
                    client.get_model_metadata("efficientnet-lite0"),
                    client.get_model_config("efficientnet-lite0"),
                    client.get_model_repository_index(),
                )
            finally:
                client.close()

        live, ready, first, second, server, metadata, config, index = await asyncio.to_thread(calls)
        assert live
        assert ready
        assert first
        assert second
        assert "classification" in server.extensions
        assert [t.name for t in metadata.inputs] == ["IMAGE"]
        assert metadata.inputs[0].datatype == "BYTES"
        assert config.config.max_batch_size >= 1
        assert config.config.input[0].name == "IMAGE"
        assert {m.name for m in index.models} == {"efficientnet-lite0", "trivial"}

        ranked = await asyncio.to_thread(
            _sync_infer, gateway.grpc_url, "efficientnet-lite0", [cat_jpeg, coffee_jpeg], 3
        )
        rows = ranked.as_numpy("PROBABILITIES")
        assert rows.shape == (2, 3)
        cat = [int(e.decode().split(":")[1]) for e in rows[0]]
        coffee = [int(e.decode().split(":")[1]) for e in rows[1]]
        assert cat[0] in CAT_CLASSES
        assert coffee[0] == ESPRESSO
        scores = (await asyncio.to_thread(_sync_infer, gateway.grpc_url, "efficientnet-lite0", [cat_jpeg])).as_numpy(
            "PROBABILITIES"
        )
        assert scores.shape == (1, 1000)
        assert scores.dtype == np.float32
        assert int(scores[0].argmax()) == cat[0]
        assert abs(float(scores[0].sum()) - 1.0) < 1e-3
        other = await asyncio.to_thread(_sync_infer, gateway.grpc_url, "trivial", [cat_jpeg])
        assert other.get_response().model_name == "trivial"
        # the same answer as the REST front for the same photo
        rest = await gateway.post(
            "/v1/models/efficientnet-lite0/classify",
            content=cat_jpeg,
            params={"top_k": 3},
            headers={"content-type": "image/jpeg"},
        )
        assert rest.status_code == 200, rest.text
        assert [label["index"] for label in rest.json()["results"][0]["labels"]] == cat


async def test_the_asyncio_client_and_the_stream(gateway_factory: MakeSettings, cat_jpeg: bytes) -> None:
    async with running_gateway(gateway_factory(models=TWO_MODELS), grpc=True) as gateway:
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        try:
            assert await client.is_server_ready()
            answer = await client.infer(
                "efficientnet-lite0",
                _inputs([cat_jpeg]),
                outputs=[triton_aio.InferRequestedOutput("PROBABILITIES", class_count=1)],
                request_id="one",
            )
            assert answer.get_response().id == "one"
            assert int(answer.as_numpy("PROBABILITIES")[0][0].decode().split(":")[1]) in CAT_CLASSES
            statistics = await client.get_inference_statistics("efficientnet-lite0")
            assert statistics.model_stats[0].inference_stats.success.count >= 1

            async def requests() -> Any:
                for i in range(6):
                    model = "efficientnet-lite0" if i % 2 == 0 else "trivial"
                    yield {"model_name": model, "inputs": _inputs([cat_jpeg]), "request_id": f"s{i}"}
                yield {"model_name": "missing", "inputs": _inputs([cat_jpeg]), "request_id": "bad"}

            answers: dict[str, Any] = {}
            errors = []
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    errors.append(str(error))
                else:
                    answers[result.get_response().id] = result
                if len(answers) + len(errors) == 7:
                    break
            assert sorted(answers) == [f"s{i}" for i in range(6)]
            assert answers["s1"].get_response().model_name == "trivial"
            assert len(errors) == 1
            assert "NOT_FOUND" in errors[0]
            assert "missing" in errors[0]
        finally:
            await client.close()


async def test_the_sync_clients_stream_as_applications_use_it(gateway_factory: MakeSettings, cat_jpeg: bytes) -> None:
    async with running_gateway(gateway_factory(), grpc=True) as gateway:

        def stream() -> list[tuple[str, str | None]]:
            got: queue.Queue[tuple[Any, Any]] = queue.Queue()
            client = triton_grpc.InferenceServerClient(gateway.grpc_url)
            try:
                client.start_stream(callback=lambda result, error: got.put((result, error)))
                for i in range(4):
                    client.async_stream_infer("efficientnet-lite0", _inputs([cat_jpeg]), request_id=str(i))
                client.async_stream_infer("efficientnet-lite0", _inputs([b"not an image"]), request_id="bad")
                answers = [got.get(timeout=30) for _ in range(5)]
                client.stop_stream()
            finally:
                client.close()
            return [(r.get_response().id if r is not None else "", None if e is None else str(e)) for r, e in answers]

        answers = await asyncio.to_thread(stream)
        assert sorted(i for i, e in answers if e is None) == ["0", "1", "2", "3"]
        [failed] = [e for _, e in answers if e is not None]
        assert "INVALID_ARGUMENT" in failed
        assert "not a recognised image" in failed


def _raw_stub(url: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(url, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _request(model: str, images: list[bytes], **fields: Any) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    tensor = request.inputs.add(name="IMAGE", datatype="BYTES", shape=[len(images)])
    tensor.contents.bytes_contents.extend(images)
    return request


async def test_hostile_requests_get_the_right_codes_and_the_server_keeps_serving(
    gateway_factory: MakeSettings, cat_jpeg: bytes
) -> None:
    settings = gateway_factory(max_images_per_request=4, max_body_bytes=1024 * 1024)
    async with running_gateway(settings, grpc=True) as gateway:

        def probes() -> dict[str, tuple[grpc.StatusCode, str]]:
            channel, stub = _raw_stub(gateway.grpc_url)
            outcomes: dict[str, tuple[grpc.StatusCode, str]] = {}

            def attempt(name: str, call: Callable[[], Any]) -> None:
                try:
                    call()
                    outcomes[name] = (grpc.StatusCode.OK, "")
                except grpc.RpcError as exc:
                    outcomes[name] = (exc.code(), exc.details() or "")

            model = "efficientnet-lite0"
            attempt("no model", lambda: stub.ModelInfer(_request("", [cat_jpeg])))
            attempt("unknown model", lambda: stub.ModelInfer(_request("nope", [cat_jpeg])))
            attempt("unknown version", lambda: stub.ModelInfer(_request(model, [cat_jpeg], model_version="9")))
            attempt("too many images", lambda: stub.ModelInfer(_request(model, [cat_jpeg] * 5)))
            wrong = service_pb2.ModelInferRequest(model_name=model)
            wrong.inputs.add(name="IMAGE", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
            attempt("wrong datatype", lambda: stub.ModelInfer(wrong))
            shape = _request(model, [cat_jpeg])
            shape.inputs[0].shape[:] = [1, 3, 224, 224]
            attempt("wrong shape", lambda: stub.ModelInfer(shape))
            lying = _request(model, [cat_jpeg])
            lying.inputs[0].shape[:] = [3]
            attempt("shape lies", lambda: stub.ModelInfer(lying))
            raw = service_pb2.ModelInferRequest(model_name=model)
            raw.inputs.add(name="IMAGE", datatype="BYTES", shape=[1])
            raw.raw_input_contents.append(b"\xff\xff\xff\x7f" + cat_jpeg[:100])
            attempt("truncated raw", lambda: stub.ModelInfer(raw))
            many = service_pb2.ModelInferRequest(model_name=model)
            for i in range(2000):
                many.inputs.add(name=f"t{i}", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x")
            attempt("many tensors", lambda: stub.ModelInfer(many))
            tiny = service_pb2.ModelInferRequest(model_name=model)
            tiny.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b""] * 200_000)
            attempt("many tiny elements", lambda: stub.ModelInfer(tiny))
            attempt("bad image", lambda: stub.ModelInfer(_request(model, [b"not an image"])))
            big = _request(model, [b"\0" * (2 * 1024 * 1024)])
            attempt("over the size limit", lambda: stub.ModelInfer(big))
            k = _request(model, [cat_jpeg])
            k.outputs.add(name="PROBABILITIES").parameters["classification"].int64_param = 5000
            attempt("k too large", lambda: stub.ModelInfer(k))
            out = _request(model, [cat_jpeg])
            out.outputs.add(name="LOGITS")
            attempt("unknown output", lambda: stub.ModelInfer(out))
            sequence = _request(model, [cat_jpeg])
            sequence.parameters["sequence_id"].int64_param = 7
            attempt("a sequence", lambda: stub.ModelInfer(sequence))
            malformed = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            attempt("malformed protobuf", lambda: malformed(b"\x0a\xff\xff\xff\xff\x0f"))
            attempt("past deadline", lambda: stub.ModelInfer(_request(model, [cat_jpeg]), timeout=0.000001))
            attempt(
                "metadata flood",
                lambda: stub.ModelInfer(_request(model, [cat_jpeg]), metadata=[("x-junk", "a" * 100_000)]),
            )
            attempt(
                "shared memory", lambda: stub.SystemSharedMemoryStatus(service_pb2.SystemSharedMemoryStatusRequest())
            )
            attempt("still serving", lambda: stub.ModelInfer(_request(model, [cat_jpeg])))
            channel.close()
            return outcomes

        outcomes = await asyncio.to_thread(probes)
    codes = {name: code for name, (code, _) in outcomes.items()}
    assert codes == {
        "no model": grpc.StatusCode.INVALID_ARGUMENT,
        "unknown model": grpc.StatusCode.NOT_FOUND,
        "unknown version": grpc.StatusCode.NOT_FOUND,
        "too many images": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong datatype": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong shape": grpc.StatusCode.INVALID_ARGUMENT,
        "shape lies": grpc.StatusCode.INVALID_ARGUMENT,
        "truncated raw": grpc.StatusCode.INVALID_ARGUMENT,
        "many tensors": grpc.StatusCode.INVALID_ARGUMENT,
        "many tiny elements": grpc.StatusCode.INVALID_ARGUMENT,
        "bad image": grpc.StatusCode.INVALID_ARGUMENT,
        "over the size limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "k too large": grpc.StatusCode.INVALID_ARGUMENT,
        "unknown output": grpc.StatusCode.INVALID_ARGUMENT,
        "a sequence": grpc.StatusCode.INVALID_ARGUMENT,
        "malformed protobuf": grpc.StatusCode.INVALID_ARGUMENT,
        "past deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
        "metadata flood": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "shared memory": grpc.StatusCode.UNIMPLEMENTED,
        "still serving": grpc.StatusCode.OK,
    }
    assert "'nope'" in outcomes["unknown model"][1]
    assert "1 to 4" in outcomes["too many images"][1]
    assert "shared memory" in outcomes["shared memory"][1]
