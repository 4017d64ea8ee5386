"""The batch's trace context reaches Triton: a Triton started with OpenTelemetry tracing puts its
own spans for the request under the gateway's ``batch`` span, over gRPC and HTTP. Triton follows
the sampled flag it is given, so with its own rate set very low it traces exactly what the gateway
samples."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loadtests.harness.otlp_receiver import OTLPReceiver
from service.settings import Settings
from service.triton.server import LocalTriton, TritonInstall
from tests.conftest import running_gateway
from tests.triton_server import start_triton

pytestmark = pytest.mark.triton

MakeSettings = Callable[..., Settings]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_triton(
    triton_install: TritonInstall,
    triton_repository: Path,
    tmp_path_factory: pytest.TempPathFactory,
    receiver: OTLPReceiver,
) -> Iterator[LocalTriton]:
    """Triton exporting its traces to the receiver within 100 ms, sampling one request in a
    million on its own (as docs/observability.md advises)."""
    trace_config = [
        "mode=opentelemetry",
        "rate=1000000",
        "level=TIMESTAMPS",
        f"opentelemetry,url={receiver.endpoint}/v1/traces",
        "opentelemetry,resource=service.name=triton",
        "opentelemetry,bsp_schedule_delay=100",
    ]
    args = tuple(arg for value in trace_config for arg in ("--trace-config", value))
    server = start_triton(triton_install, triton_repository, tmp_path_factory.mktemp("traced-triton"), extra_args=args)
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_triton_joins_the_batchs_trace(
    gateway_factory: MakeSettings,
    traced_triton: LocalTriton,
    receiver: OTLPReceiver,
    cat_jpeg: bytes,
    protocol: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    digit = "7" if protocol == "grpc" else "8"
    url = traced_triton.grpc_url if protocol == "grpc" else traced_triton.http_url
    settings = gateway_factory(
        backend="triton",
        triton_url=url,
        triton_protocol=protocol,
        tracing_endpoint=receiver.endpoint,
        tracing_sample_ratio=0.0,
    )
    # Triton (24.10) does not trace every sampled request it is given: locally the first one after
    # its start was sometimes left out, and in one CI run under load two of three were. So traced
    # requests go one at a time until two have Triton spans (at most eight), and every one that
    # joined must sit under its batch.
    traced: list[str] = []
    joined: list[str] = []
    async with running_gateway(settings) as client:
        for n in range(8):
            trace_id = f"{digit * 31}{n}"
            traced.append(trace_id)
            r = await client.post(
                "/classify",
                content=cat_jpeg,
                headers={"content-type": "image/jpeg", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
            )
            assert r.status_code == 200, r.text
            try:
                await receiver.until(lambda s, t=trace_id: any(x.service == "triton" and x.trace_id == t for x in s), 5)
            except TimeoutError:
                continue
            joined.append(trace_id)
            if len(joined) == 2:
                break
        assert len(joined) == 2, f"Triton joined {joined} of {traced}; exports refused: {receiver.rejected}"
        for _ in range(3):  # not sampled by the gateway (ratio 0, no traceparent): Triton traces none
            unsampled = await client.post("/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
            assert unsampled.status_code == 200
        spans = await receiver.until(
            lambda s: sum(x.name == "batch" and x.trace_id in traced for x in s) == len(traced), timeout=30
        )
    await asyncio.sleep(0.5)  # Triton exports every 100 ms: an unsampled request's spans would be here
    spans = receiver.spans()
    for trace_id in joined:
        mine = [s for s in spans if s.trace_id == trace_id]
        (batch,) = [s for s in mine if s.name == "batch"]
        triton_spans = [s for s in mine if s.service == "triton"]
        assert {"InferRequest", "compute"} <= {s.name for s in triton_spans}
        roots = [s for s in triton_spans if s.parent_id not in {t.span_id for t in triton_spans}]
        assert roots
        assert all(s.parent_id == batch.span_id for s in roots), [(s.name, s.parent_id) for s in triton_spans]
    # nothing unsampled (the receiver also holds the other protocol's sampled traces)
    assert {s.trace_id[:31] for s in spans if s.service == "triton"} <= {"7" * 31, "8" * 31}
