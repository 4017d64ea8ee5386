"""OpenTelemetry traces, received by a real OTLP/HTTP receiver on loopback; exemplars; request ids."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtests.harness.otlp_receiver import OTLPReceiver, ReceivedSpan
from service.backends.fake import FakeBackend
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


def traceparent(trace_id: str = CLIENT_TRACE, parent: str = CLIENT_PARENT, sampled: bool = True) -> str:
    return f"00-{trace_id}-{parent}-{'01' if sampled else '00'}"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    with OTLPReceiver() as running:
        yield running


def png(value: int) -> bytes:
    return png_bytes(solid_image(value, 32))


def traced(make: Callable[..., Settings], receiver: OTLPReceiver, ratio: float) -> Settings:
    return make(backend="fake", tracing_endpoint=receiver.endpoint, tracing_sample_ratio=ratio)


async def post_png(client: httpx.AsyncClient, value: int, **headers: str) -> httpx.Response:
    """POST a PNG of class ``value`` (with a sampled traceparent unless told otherwise)."""
    headers = {"content-type": "image/png", "traceparent": traceparent(), **headers}
    return await client.post("/classify", content=png(value), headers={k: v for k, v in headers.items() if v})


def one(spans: list[ReceivedSpan], name: str, trace_id: str | None = None) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and (trace_id is None or s.trace_id == trace_id)]
    assert len(found) == 1, f"{len(found)} spans named {name!r} in {[s.name for s in spans]}"
    return found[0]


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        if span.parent_id == parent.span_id and span.trace_id == parent.trace_id:
            out.setdefault(span.name, []).append(span)
    return out


async def test_an_online_request_is_one_trace_under_the_clients_parent(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    settings = traced(gateway_factory, receiver, 0.0)
    async with running_gateway(settings, FakeBackend()) as client:
        r = await post_png(client, 1)
        assert r.status_code == 200
        spans = await receiver.until(lambda s: any(x.name == "POST /classify" for x in s) and len(s) >= 4)
    server = one(spans, "POST /classify")
    assert (server.trace_id, server.parent_id, server.kind) == (CLIENT_TRACE, CLIENT_PARENT, "server")
    assert server.attributes["http.route"] == "/classify"
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource["service.name"] == "inference-gateway"
    assert server.resource["gateway.role"] == "gateway"
    below = children(spans, server)
    (decode,) = below["decode"]
    (wait,) = below["batch wait"]
    (batch,) = below["batch"]  # the batch is a child of its first (here only) request
    assert batch.kind == "client"
    assert batch.attributes["gateway.batch.size"] == 1
    assert batch.attributes["gateway.backend"] == "fake"
    assert (CLIENT_TRACE, server.span_id) in batch.links
    assert wait.links == [(CLIENT_TRACE, batch.span_id)]
    # in time order: decoded, waited, then the batch ran; all within the request
    assert server.start_ns <= decode.start_ns <= decode.end_ns <= wait.start_ns + 1_000_000
    assert wait.end_ns <= batch.start_ns + 1_000_000
    assert batch.end_ns <= server.end_ns
    assert r.headers["x-request-id"]


async def test_unsampled_requests_make_no_spans(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    """Ratio 0 and a caller that did not sample: nothing is exported, not even the server span;
    a caller that did sample is traced under the same settings."""
    settings = traced(gateway_factory, receiver, 0.0)
    async with running_gateway(settings, FakeBackend()) as client:
        for value in range(3):
            assert (await post_png(client, value, traceparent="")).status_code == 200
        assert (await post_png(client, 9, traceparent=traceparent(sampled=False))).status_code == 200
        assert (await post_png(client, 7)).status_code == 200
        spans = await receiver.until(lambda s: any(x.name == "batch" for x in s))
        await asyncio.sleep(0.3)
        spans = receiver.spans()
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}


async def test_a_multi_image_request_has_a_decode_and_a_wait_per_image(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    settings = traced(gateway_factory, receiver, 1.0)
    files = [("file", (f"{i}.png", png(i), "image/png")) for i in range(3)]
    async with running_gateway(settings, FakeBackend()) as client:
        r = await client.post("/classify", files=files)
        assert r.status_code == 200
        spans = await receiver.until(lambda s: any(x.name == "POST /classify" for x in s))
    server = one(spans, "POST /classify")
    assert not server.parent_id  # no traceparent: a new trace, sampled at ratio 1
    below = children(spans, server)
    assert len(below["decode"]) == 3
    assert len(below["batch wait"]) == 3
    batches = [s for s in spans if s.name == "batch"]
    assert sum(b.attributes["gateway.batch.size"] for b in batches) == 3
    for batch in batches:
        assert batch.parent_id == server.span_id
        assert batch.links == [(server.trace_id, server.span_id)] * batch.attributes["gateway.batch.size"]


async def test_a_batch_shared_by_two_traced_requests_links_both(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    """Two requests arriving while the backend is busy share the next batch: that batch is a child
    of one request and linked to both; each request's wait span links to it."""
    backend = FakeBackend(delay=0.3)
    settings = gateway_factory(
        backend="fake", tracing_endpoint=receiver.endpoint, tracing_sample_ratio=1.0, max_delay=0.2
    )
    async with running_gateway(settings, backend) as client:

        async def post(value: int, trace_id: str) -> None:
            assert (await post_png(client, value, traceparent=traceparent(trace_id))).status_code == 200

        first = asyncio.create_task(post(1, "1" * 32))  # occupies the backend
        await asyncio.sleep(0.1)
        await asyncio.gather(first, post(2, "2" * 32), post(3, "3" * 32))
        spans = await receiver.until(lambda s: sum(x.name == "POST /classify" for x in s) == 3)
    shared = [s for s in spans if s.name == "batch" and s.attributes["gateway.batch.size"] == 2]
    assert len(shared) == 1, [(s.name, s.attributes) for s in spans if s.name == "batch"]
    batch = shared[0]
    servers = {s.trace_id: s for s in spans if s.name == "POST /classify"}
    assert sorted(trace for trace, _ in batch.links) == ["2" * 32, "3" * 32]
    assert {span for _, span in batch.links} == {servers["2" * 32].span_id, servers["3" * 32].span_id}
    assert batch.parent_id in {servers["2" * 32].span_id, servers["3" * 32].span_id}
    for trace_id in ("2" * 32, "3" * 32):
        wait = one(spans, "batch wait", trace_id)
        assert wait.links == [(batch.trace_id, batch.span_id)]


async def test_a_failed_request_is_marked_on_its_span_with_its_request_id(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    settings = traced(gateway_factory, receiver, 1.0)
    async with running_gateway(settings, FakeBackend()) as client:
        r = await client.post(
            "/classify", content=b"not an image", headers={"content-type": "image/png", "x-request-id": "req-42"}
        )
        spans = await receiver.until(lambda s: any(x.name == "POST /classify" for x in s))
    assert r.status_code == 400
    assert r.json()["request_id"] == "req-42" == r.headers["x-request-id"]
    server = one(spans, "POST /classify")
    assert server.attributes["gateway.error"] == "bad_image"
    decode = one(spans, "decode")
    assert decode.status == 2
    assert decode.attributes["error.type"] == "bad_image"


async def test_latency_histograms_carry_trace_exemplars_in_openmetrics(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    settings = traced(gateway_factory, receiver, 1.0)
    async with running_gateway(settings, FakeBackend()) as client:
        r = await post_png(client, 5)
        assert r.status_code == 200
        plain = await client.get("/metrics")
        open_metrics = await client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert plain.headers["content-type"].startswith("text/plain")
    assert "# {trace_id=" not in plain.text  # the classic format has no exemplars
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")
    exemplar = f'# {{trace_id="{CLIENT_TRACE}"}}'
    for family in (
        "gateway_http_request_duration_seconds_bucket",
        "gateway_preprocess_duration_seconds_bucket",
        "gateway_queue_wait_seconds_bucket",
        "gateway_backend_duration_seconds_bucket",
    ):
        lines = [line for line in open_metrics.text.splitlines() if line.startswith(family) and exemplar in line]
        assert lines, f"no exemplar with the request's trace id on {family}"


async def test_tracing_off_exports_nothing_and_keeps_request_ids(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        r = await post_png(client, 1)
        bad = await client.post("/classify?top_k=0", content=png(1), headers={"content-type": "image/png"})
        missing = await client.get("/nowhere", headers={"x-request-id": "bad id with spaces"})
    assert r.status_code == 200
    assert len(r.headers["x-request-id"]) == 16
    assert bad.status_code == 422
    assert bad.json()["request_id"] == bad.headers["x-request-id"]
    assert missing.status_code == 404
    assert missing.json()["request_id"] == missing.headers["x-request-id"] != "bad id with spaces"
    await asyncio.sleep(0.2)
    assert receiver.requests == 0


async def test_a_grpc_call_is_one_trace_under_the_clients_parent(
    gateway_factory: Callable[..., Settings], receiver: OTLPReceiver
) -> None:
    """A ``ModelInfer`` call with ``traceparent`` metadata: its server span (``grpc ModelInfer``,
    the RPC conventions' attributes) under the client's parent, with the decode, wait and batch
    below it as for HTTP."""
    settings = traced(gateway_factory, receiver, 0.0)
    async with running_gateway(settings, FakeBackend(), grpc=True) as client:
        request = service_pb2.ModelInferRequest(model_name="efficientnet-lite0")
        request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(png(1))
        async with grpc.aio.insecure_channel(client.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(request, metadata=[("traceparent", traceparent())])
        spans = await receiver.until(lambda s: any(x.name == "grpc ModelInfer" for x in s) and len(s) >= 4)
    server = one(spans, "grpc ModelInfer")
    assert (server.trace_id, server.parent_id, server.kind) == (CLIENT_TRACE, CLIENT_PARENT, "server")
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["rpc.method"] == "ModelInfer"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert {"decode", "batch wait", "batch"} <= set(children(spans, server))
