"""An offline job is one trace across processes: the API's request and publish, the worker's job
(decode, batch wait, batch) through the real RabbitMQ, and the result's arrival back at the API;
the worker's log lines name the job they are about."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loadtests.harness.otlp_receiver import OTLPReceiver, ReceivedSpan
from service.backends.fake import FakeBackend
from service.jobs.ingest import run_ingest
from service.jobs.messages import DEFAULT_REPLY_TO, request_message
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.logs import gateway_handler
from service.settings import Settings
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, broker_ok, class_pngs, collect_results, publish

pytestmark = pytest.mark.rabbitmq

TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with OTLPReceiver() as running:
        yield running


def offline_traced(make: Callable[..., Settings], prefix: str, receiver: OTLPReceiver, ratio: float) -> Settings:
    return make(
        backend="fake",
        broker_url=BROKER_URL,
        queue_prefix=prefix,
        worker_metrics_port=0,
        tracing_endpoint=receiver.endpoint,
        tracing_sample_ratio=ratio,
    )


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


async def test_an_offline_job_is_one_trace_from_api_through_worker_and_back(
    gateway_factory: Callable[..., Settings], prefix: str, receiver: OTLPReceiver
) -> None:
    settings = offline_traced(gateway_factory, prefix, receiver, 0.0)  # only what the caller sampled
    stop = asyncio.Event()
    async with running_gateway(settings, FakeBackend()) as client:
        await broker_ok(client)
        files = [("file", (f"{i}.png", png_bytes(solid_image(i, 16)), "image/png")) for i in (3, 4)]
        accepted = await client.post(
            "/classify",
            params={"mode": "offline"},
            files=files,
            headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"},
        )
        assert accepted.status_code == 202, accepted.text
        unsampled = await client.post(
            "/classify",
            params={"mode": "offline"},
            content=png_bytes(solid_image(9, 16)),
            headers={"content-type": "image/png"},
        )
        assert unsampled.status_code == 202
        job_ids = [job["job_id"] for job in accepted.json()["jobs"]]
        # the worker samples every new trace: the unsampled job must still not be traced there, as
        # its message says "not sampled" (a trace is whole or absent)
        worker_settings = settings.model_copy(update={"tracing_sample_ratio": 1.0})
        worker = asyncio.create_task(run_worker(worker_settings, stop, FakeBackend()))
        try:
            spans = await receiver.until(lambda s: len(by_name(s, "job result")) == 2, timeout=60)
        finally:
            stop.set()
            await worker
        await asyncio.sleep(0.3)
        spans = receiver.spans()

    assert {s.trace_id for s in spans} == {TRACE}  # the unsampled job left no span anywhere
    (server,) = by_name(spans, "POST /classify")
    publishes = by_name(spans, "publish job")
    jobs = by_name(spans, "job")
    results = by_name(spans, "job result")
    assert sorted(p.attributes["messaging.message.id"] for p in publishes) == sorted(job_ids)
    for sent in publishes:
        assert (sent.parent_id, sent.kind, sent.resource["gateway.role"]) == (
            server.span_id,
            "producer",
            "gateway",
        )
        (job,) = [j for j in jobs if j.parent_id == sent.span_id]
        assert (job.kind, job.resource["gateway.role"]) == ("consumer", "worker")
        assert job.attributes["messaging.message.id"] == sent.attributes["messaging.message.id"]
        assert job.attributes["gateway.job.outcome"] == "done"
        under_job = {s.name for s in spans if s.parent_id == job.span_id}
        assert {"decode", "batch wait"} <= under_job
        (result,) = [r for r in results if r.parent_id == job.span_id]
        assert (result.kind, result.resource["gateway.role"]) == ("consumer", "gateway")
        assert result.attributes["gateway.job.status"] == "done"
    batches = by_name(spans, "batch")
    assert batches
    assert all(b.resource["gateway.role"] == "worker" for b in batches)
    assert {span for _, span in (link for b in batches for link in b.links)} == {j.span_id for j in jobs}


async def test_the_workers_log_lines_name_the_job(gateway_factory: Callable[..., Settings], prefix: str) -> None:
    stream = io.StringIO()
    handler = gateway_handler("json", 10.0, stream)
    logging.getLogger().addHandler(handler)
    settings = gateway_factory(backend="fake", broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0)
    names = Names(prefix)
    stop = asyncio.Event()
    try:
        await publish(
            names,
            request_message(
                b"not an image",
                job_id="job-bad-1",
                content_type="image/png",
                filename="x.png",
                top_k=1,
                reply_to=DEFAULT_REPLY_TO,
            ),
        )
        worker = asyncio.create_task(run_worker(settings, stop, FakeBackend()))
        try:
            (result,) = await collect_results(names, 1)
        finally:
            stop.set()
            await worker
    finally:
        logging.getLogger().removeHandler(handler)
    assert result.status == "failed"
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    dead = [line for line in lines if "dead-lettered" in str(line["message"])]
    assert dead, stream.getvalue()
    assert dead[0]["job_id"] == "job-bad-1"


async def test_gateway_ingest_makes_a_trace_per_image(
    gateway_factory: Callable[..., Settings], prefix: str, receiver: OTLPReceiver, tmp_path: Path
) -> None:
    class_pngs(tmp_path / "photos", 3)
    settings = offline_traced(gateway_factory, prefix, receiver, 1.0)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, FakeBackend()))
    try:
        assert await run_ingest(settings, [tmp_path / "photos"], tmp_path / "out.jsonl") == 0
    finally:
        stop.set()
        await worker  # its spans are flushed as it stops
    spans = await receiver.until(lambda s: len(by_name(s, "job result")) == len(by_name(s, "job")) == 3)
    publishes = by_name(spans, "publish job")
    assert len(publishes) == 3
    assert len({p.trace_id for p in publishes}) == 3  # one trace per image
    for sent in publishes:
        assert not sent.parent_id
        assert sent.resource["gateway.role"] == "ingest"
        (job,) = [s for s in by_name(spans, "job") if s.parent_id == sent.span_id]
        assert job.resource["gateway.role"] == "worker"
        (result,) = [s for s in by_name(spans, "job result") if s.parent_id == job.span_id]
        assert result.resource["gateway.role"] == "ingest"
