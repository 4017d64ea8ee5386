"""The gRPC front keeps the gateway's limits: API keys and their quotas from metadata, room,
deadlines, cancellation (a call its client cancels leaves the batcher), many calls on one
connection, and a rapid-reset flood (HTTP/2 streams opened and reset at once) that leaves the
server serving others. Metrics count the calls by method and code."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.settings import Settings
from tests.conftest import running_gateway

MakeSettings = Callable[..., Settings]
MODEL = "efficientnet-lite0"


def _request(images: list[bytes], model: str = MODEL) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="IMAGE", datatype="BYTES", shape=[len(images)])
    tensor.contents.bytes_contents.extend(images)
    return request


def _inputs(image: bytes) -> list[triton_aio.InferInput]:
    tensor = triton_aio.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    return [tensor]


async def _code(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        trailers = {k: v for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str)}
        return exc.code(), exc.details() or "", trailers
    except asyncio.CancelledError:  # what awaiting a call this client cancelled raises
        return grpc.StatusCode.CANCELLED, "", {}
    return grpc.StatusCode.OK, "", {}


async def test_api_keys_and_quotas_come_from_metadata(gateway_factory: MakeSettings, cat_jpeg: bytes) -> None:
    keys = "alpha rate=2 burst=2,beta models=trivial"
    settings = gateway_factory(models="efficientnet-lite0,trivial", api_keys=keys)
    async with running_gateway(settings, grpc=True) as gateway, grpc.aio.insecure_channel(gateway.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        live = await stub.ServerLive(service_pb2.ServerLiveRequest())  # open, as /v2/health/live
        assert live.live
        none = await _code(stub.ModelInfer(_request([cat_jpeg])))
        wrong = await _code(stub.ModelInfer(_request([cat_jpeg]), metadata=[("x-api-key", "gamma")]))
        metadata = await _code(stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=MODEL)))
        bearer = await _code(stub.ModelInfer(_request([cat_jpeg]), metadata=[("authorization", "Bearer alpha")]))
        header = await _code(stub.ModelInfer(_request([cat_jpeg]), metadata=[("x-api-key", "alpha")]))
        over = await _code(stub.ModelInfer(_request([cat_jpeg]), metadata=[("x-api-key", "alpha")]))
        other = await _code(stub.ModelInfer(_request([cat_jpeg]), metadata=[("x-api-key", "beta")]))
        allowed = await _code(stub.ModelInfer(_request([cat_jpeg], "trivial"), metadata=[("x-api-key", "beta")]))
    assert none[0] == wrong[0] == metadata[0] == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <key>" in none[1]
    assert bearer[0] == header[0] == allowed[0] == grpc.StatusCode.OK
    assert over[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate of 2 images/s" in over[1]
    assert over[2]["gateway-error"] == "quota_exceeded"
    assert int(over[2]["retry-after"]) >= 1
    assert other[0] == grpc.StatusCode.PERMISSION_DENIED
    assert "trivial" in other[1]


async def test_a_full_model_a_deadline_and_a_cancelled_call(gateway_factory: MakeSettings, cat_jpeg: bytes) -> None:
    """The fake backend takes 1 s a batch, one batch at a time, and the model takes 2 requests:
    a third is RESOURCE_EXHAUSTED with retry-after; a call whose deadline is shorter than its wait
    is DEADLINE_EXCEEDED; a call cancelled while its image waits leaves the batcher (the images
    abandoned are counted) and is a disconnect, not a failure."""
    settings = gateway_factory(
        backend="fake", fake_delay=1.0, max_concurrent_requests=2, max_batch_size=1, max_inflight_batches=1
    )
    async with running_gateway(settings, grpc=True) as gateway:
        metrics = gateway.app.state.gateway.metrics
        abandoned = metrics.abandoned_images._value.get()
        async with grpc.aio.insecure_channel(gateway.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            first = asyncio.create_task(_code(stub.ModelInfer(_request([cat_jpeg]))))
            await asyncio.sleep(0.2)
            waiting = stub.ModelInfer(_request([cat_jpeg]))
            await asyncio.sleep(0.2)
            full = await _code(stub.ModelInfer(_request([cat_jpeg])))
            waiting.cancel()  # its image waits behind the first batch
            assert (await _code(waiting))[0] == grpc.StatusCode.CANCELLED
            assert (await first)[0] == grpc.StatusCode.OK
            late = await _code(stub.ModelInfer(_request([cat_jpeg]), timeout=0.3))
            timed = _request([cat_jpeg])  # tritonclient's infer(timeout=...): Triton's server-side timeout
            timed.parameters["timeout"].int64_param = 300_000
            own_timeout = await _code(stub.ModelInfer(timed))
            async with asyncio.timeout(5):
                while metrics.abandoned_images._value.get() < abandoned + 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            again = await _code(stub.ModelInfer(_request([cat_jpeg])))
        exposition = (await gateway.get("/metrics")).text
    assert full[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full[2]["gateway-error"] == "queue_full"
    assert "retry-after" in full[2]
    assert late[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert own_timeout[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert again[0] == grpc.StatusCode.OK
    assert 'gateway_grpc_requests_total{code="OK",method="ModelInfer"}' in exposition
    assert 'gateway_grpc_requests_total{code="RESOURCE_EXHAUSTED",method="ModelInfer"}' in exposition
    assert 'gateway_grpc_requests_total{code="CANCELLED",method="ModelInfer"}' in exposition


async def test_many_calls_on_one_connection_wait_for_its_streams(
    gateway_factory: MakeSettings, cat_jpeg: bytes
) -> None:
    """64 calls at once on one channel whose connection may carry 4: every one is answered (the rest
    wait for a stream), and another client is served meanwhile."""
    settings = gateway_factory(grpc_max_concurrent_streams=4, max_concurrent_requests=128)
    async with running_gateway(settings, grpc=True) as gateway:
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        other = triton_aio.InferenceServerClient(gateway.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        try:
            assert await client.is_server_live()  # connected: the server's SETTINGS are known
            calls = [asyncio.create_task(client.infer(MODEL, _inputs(cat_jpeg), request_id=str(i))) for i in range(64)]
            assert await other.is_server_live()
            answers = await asyncio.gather(*calls)
        finally:
            await client.close()
            await other.close()
    assert sorted(int(a.get_response().id) for a in answers) == list(range(64))


def _model_infer_headers(port: int, metadata: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """A ModelInfer call's HTTP/2 headers, as a gRPC client sends them."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *(metadata or []),
    ]


def _rapid_reset(port: int, streams: int) -> str:
    """Open ``streams`` ModelInfer streams on one connection and reset each at once (CVE-2023-44487);
    what the server did: "goaway" (it closed the connection) or "survived" (it took them all)."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(connection.data_to_send())
        headers = _model_infer_headers(port)
        try:
            for i in range(streams):
                stream = connection.get_next_available_stream_id()
                connection.send_headers(stream, headers)
                connection.reset_stream(stream)
                if i % 100 == 99:
                    sock.sendall(connection.data_to_send())
            sock.sendall(connection.data_to_send())
            sock.settimeout(5)
            while data := sock.recv(65536):
                for event in connection.receive_data(data):
                    if type(event).__name__ == "ConnectionTerminated":
                        return "goaway"
                sock.sendall(connection.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            return "goaway"
    return "survived"


async def test_a_rapid_reset_flood_leaves_the_server_serving_others(
    gateway_factory: MakeSettings, cat_jpeg: bytes
) -> None:
    async with running_gateway(gateway_factory(), grpc=True) as gateway:
        port = int(gateway.grpc_url.rsplit(":", 1)[1])
        flood = asyncio.create_task(asyncio.to_thread(_rapid_reset, port, 20_000))
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        try:
            started = time.monotonic()
            while not flood.done():
                answer = await client.infer(MODEL, _inputs(cat_jpeg))
                assert answer.as_numpy("PROBABILITIES").shape == (1, 1000)
                await asyncio.sleep(0.05)
            outcome = await flood
            assert await client.is_server_live()
        finally:
            await client.close()
    assert outcome in ("goaway", "survived")
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
async def test_a_stream_needs_a_key_too(gateway_factory: MakeSettings, cat_jpeg: bytes, header: str) -> None:
    async with running_gateway(gateway_factory(api_keys="alpha"), grpc=True) as gateway:
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        value = "Bearer alpha" if header == "authorization" else "alpha"

        async def one() -> Any:
            yield {"model_name": MODEL, "inputs": _inputs(cat_jpeg), "request_id": "k"}

        try:

            async def without_key() -> None:
                async for _ in client.stream_infer(one()):
                    break

            with pytest.raises((InferenceServerException, grpc.aio.AioRpcError), match="API key"):
                await without_key()
            async for result, error in client.stream_infer(one(), headers={header: value}):
                assert error is None
                assert result.get_response().id == "k"
                break
        finally:
            await client.close()


async def test_load_and_unload_over_grpc_need_the_admin_key(gateway_factory: MakeSettings, tmp_path: Path) -> None:
    """``load_model``/``unload_model`` of ``tritonclient.grpc`` under a memory budget, with the admin
    key as ``x-admin-key`` metadata: without it or with a wrong one PERMISSION_DENIED and nothing
    changes; with it, the index says what changed; a load with a configuration is INVALID_ARGUMENT."""
    models = tmp_path / "models.toml"
    models.write_text(
        "".join(
            f"[models.{name}]\nprofile = 'trivial'\nbackend = 'fake'\nfake_delay = 0.002\nmemory = {100 << 20}\n"
            for name in ("a", "b")
        )
    )
    admin = {"x-admin-key": "an-admin-key"}
    settings = gateway_factory(models_file=models, model_memory_budget=250 << 20, admin_key="an-admin-key")
    async with running_gateway(settings, grpc=True) as gateway:
        client = triton_aio.InferenceServerClient(gateway.grpc_url)

        async def states() -> dict[str, str]:
            index = await client.get_model_repository_index()
            return {entry.name: entry.state for entry in index.models}

        try:
            assert await states() == {"a": "READY", "b": "UNAVAILABLE"}
            for headers in (None, {"x-admin-key": "wrong"}):
                with pytest.raises(InferenceServerException, match="X-Admin-Key is missing or wrong") as caught:
                    await client.load_model("b", headers=headers)
                assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
            assert await states() == {"a": "READY", "b": "UNAVAILABLE"}
            await client.load_model("b", headers=admin)
            await client.unload_model("a", headers=admin)
            assert await states() == {"a": "UNAVAILABLE", "b": "READY"}
            with pytest.raises(InferenceServerException, match="are not supported") as caught:
                await client.load_model("a", headers=admin, config='{"max_batch_size": 8}')
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        finally:
            await client.close()


def _headers_only(port: int, metadata: list[tuple[str, str]]) -> dict[str, str]:
    """A ModelInfer call's headers and no message (a client about to send a large one): what the
    server answers within 5 s, as the trailers' fields ({} for nothing)."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    connection.initiate_connection()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        stream = connection.get_next_available_stream_id()
        connection.send_headers(stream, _model_infer_headers(port, metadata))
        sock.sendall(connection.data_to_send())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    fields = dict(event.headers)
                    if "grpc-status" in fields:
                        return fields
            sock.sendall(connection.data_to_send())
    return {}


async def test_a_call_without_a_key_is_refused_before_its_message(gateway_factory: MakeSettings) -> None:
    """Without a valid key the call is UNAUTHENTICATED as soon as its headers arrive, its message
    unread (a client cannot make the server buffer messages it will refuse); with one, the server
    waits for the message."""
    async with running_gateway(gateway_factory(api_keys="alpha"), grpc=True) as gateway:
        port = int(gateway.grpc_url.rsplit(":", 1)[1])
        refused = await asyncio.to_thread(_headers_only, port, [("x-api-key", "wrong")])
        waiting = await asyncio.to_thread(_headers_only, port, [("x-api-key", "alpha")])
    assert refused["grpc-status"] == str(grpc.StatusCode.UNAUTHENTICATED.value[0])
    assert "API key" in refused["grpc-message"]
    assert waiting == {}


async def test_a_streams_requests_take_the_keys_slots_and_a_closing_gateway_ends_it(
    gateway_factory: MakeSettings, cat_jpeg: bytes
) -> None:
    """A key of concurrency 1 streams three requests at once: one is answered, the others are
    RESOURCE_EXHAUSTED (a stream does not pass the key's limit); once the gateway is shutting down,
    a stream's next request is UNAVAILABLE and the stream ends."""
    settings = gateway_factory(api_keys="beta concurrency=1", backend="fake", fake_delay=0.5)
    async with running_gateway(settings, grpc=True) as gateway:
        client = triton_aio.InferenceServerClient(gateway.grpc_url)
        key = {"x-api-key": "beta"}

        async def three() -> Any:
            for i in range(3):
                yield {"model_name": MODEL, "inputs": _inputs(cat_jpeg), "request_id": str(i)}

        outcomes = []
        try:
            async for _, error in client.stream_infer(three(), headers=key):
                outcomes.append("OK" if error is None else str(error).split(":")[0])
                if len(outcomes) == 3:
                    break
            gate = asyncio.Event()

            async def after_closing() -> Any:
                yield {"model_name": MODEL, "inputs": _inputs(cat_jpeg), "request_id": "first"}
                await gate.wait()
                yield {"model_name": MODEL, "inputs": _inputs(cat_jpeg), "request_id": "late"}

            closing = []
            async for result, error in client.stream_infer(after_closing(), headers=key):
                closing.append((None if result is None else result.get_response().id, error and str(error)))
                gateway.app.state.gateway.closing = True
                gate.set()
        finally:
            gateway.app.state.gateway.closing = False
            await client.close()
    assert sorted(outcomes) == ["OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]
    assert closing[0] == ("first", None)
    assert closing[1][1] is not None
    assert "UNAVAILABLE: the gateway is shutting down" in closing[1][1]
    assert len(closing) == 2  # and the stream ended


async def test_metrics_say_the_code_each_call_ended_with(gateway_factory: MakeSettings, cat_jpeg: bytes) -> None:
    """UNIMPLEMENTED and a cancelled stream are counted as such, never as OK."""
    settings = gateway_factory(backend="fake", fake_delay=1.0)
    async with running_gateway(settings, grpc=True) as gateway:
        async with grpc.aio.insecure_channel(gateway.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            unimplemented = await _code(stub.TraceSetting(service_pb2.TraceSettingRequest()))
            stream = stub.ModelStreamInfer(iter([_request([cat_jpeg])]))
            await asyncio.sleep(0.3)
            stream.cancel()
        metrics = gateway.app.state.gateway.metrics
        async with asyncio.timeout(5):
            while metrics.grpc_requests.labels("ModelStreamInfer", "CANCELLED")._value.get() < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        exposition = (await gateway.get("/metrics")).text
    assert unimplemented[0] == grpc.StatusCode.UNIMPLEMENTED
    assert 'gateway_grpc_requests_total{code="UNIMPLEMENTED",method="TraceSetting"} 1.0' in exposition
    assert 'code="OK",method="TraceSetting"' not in exposition
    assert 'code="OK",method="ModelStreamInfer"' not in exposition
