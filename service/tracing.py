"""OpenTelemetry traces, off unless ``GATEWAY_TRACING_ENDPOINT`` names an OTLP/HTTP collector.

The shape of a trace (see docs/observability.md):

* ``POST /classify`` (the server span, made by ``service.http.middleware.RequestMiddleware``; a client's
  W3C ``traceparent`` is its parent) with, per image, ``decode`` (in the decode thread) and
  ``batch wait`` (admission to dispatch, linked to the batch it joined);
* ``batch`` (one per backend call, a child of the first sampled request it serves, linked to every
  sampled request in it). Its context goes to Triton in the gRPC/HTTP headers, so a Triton started
  with OpenTelemetry tracing adds its spans under it;
* offline mode: the context travels in the AMQP message headers (``traceparent``) from the API or
  ``gateway ingest`` to the worker, whose ``job`` span is the parent of that image's decode, wait
  and batch spans, and on to the result message, whose receipt by the API is a last span.

Sampling: a caller's decision (the ``traceparent`` sampled flag) is kept; other traces are sampled
at ``GATEWAY_TRACING_SAMPLE_RATIO``. The HTTP edge decides for a new trace before any span work
(``server_context``), so an unsampled request costs a random number and a context switch, not a
span: with FastAPI's own telemetry layer, 1 % sampling cost 17 % of the serving path's throughput.
Elsewhere (worker, ingest) the SDK's ``ParentBased(TraceIdRatioBased)`` sampler decides.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from service import __version__

if TYPE_CHECKING:
    from service.settings import Settings

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"


def sampled_context() -> SpanContext | None:
    """The current span's context if this trace is sampled (its spans are exported), else None."""
    context = trace.get_current_span().get_span_context()
    return context if context.trace_flags.sampled else None


def trace_id_hex(context: SpanContext) -> str:
    return format(context.trace_id, "032x")


def as_parent(context: SpanContext) -> otel_context.Context:
    """An OTel context whose current span is ``context`` (to start a child of it anywhere)."""
    return trace.set_span_in_context(NonRecordingSpan(context))


def epoch_ns(monotonic: float, now_monotonic: float) -> int:
    """A time on a monotonic clock (the event loop's), as the epoch nanoseconds spans carry."""
    return time.time_ns() - int((now_monotonic - monotonic) * 1e9)


def inject(carrier: MutableMapping[str, Any], context: otel_context.Context | None = None) -> None:
    """Write the W3C trace headers of ``context`` (default: the current one) into ``carrier``."""
    propagate.inject(carrier, context=context)


def extract(carrier: Mapping[str, Any]) -> otel_context.Context:
    """The context a ``traceparent`` in ``carrier`` names (an empty one when there is none)."""
    return propagate.extract({k: str(v) for k, v in carrier.items() if isinstance(k, str)})


def current_headers() -> dict[str, str]:
    """The W3C headers of the current span (empty outside one): what a message carries onwards."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        inject(carrier)
    return carrier


def publishing(tracing: Tracing | None, job_id: str) -> AbstractContextManager[dict[str, str]]:
    """``tracing.producer(job_id)``, or no span and no headers when tracing is off."""
    return tracing.producer(job_id) if tracing is not None else nullcontext({})


class Tracing:
    """The process's tracer provider and the gateway's tracer. Built by the composition roots (the
    app, the worker, ``gateway ingest``) from the settings; ``None`` there means tracing is off."""

    def __init__(self, provider: TracerProvider, sample_ratio: float) -> None:
        self.provider = provider
        self.sample_ratio = sample_ratio
        self.tracer = provider.get_tracer("inference-gateway", __version__)

    @classmethod
    def create(
        cls,
        endpoint: str | None,
        service_name: str,
        sample_ratio: float,
        *,
        role: str,
        exporter: SpanExporter | None = None,
    ) -> Tracing | None:
        """``None`` (tracing off) without an endpoint or an exporter. ``role`` (gateway, worker,
        ingest) tells a process's spans apart under one service name. The gateway's HTTP edge
        samples new traces itself (``server_context``), so its SDK sampler only follows parents."""
        if exporter is None:
            if not endpoint:
                return None
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            url = endpoint.rstrip("/")
            exporter = OTLPSpanExporter(endpoint=url if url.endswith(TRACES_PATH) else url + TRACES_PATH)
        resource = Resource.create({"service.name": service_name, "service.version": __version__, "gateway.role": role})
        root = ALWAYS_ON if role == "gateway" else TraceIdRatioBased(sample_ratio)
        provider = TracerProvider(resource=resource, sampler=ParentBased(root))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        logger.info("tracing: %s spans to %s, sampling %g of new traces", role, endpoint, sample_ratio)
        return cls(provider, sample_ratio)

    @classmethod
    def from_settings(cls, settings: Settings, role: str) -> Tracing | None:
        return cls.create(
            settings.tracing_endpoint, settings.tracing_service_name, settings.tracing_sample_ratio, role=role
        )

    def server_context(
        self, method: str, path: str, scheme: str, carrier: dict[str, str]
    ) -> tuple[trace.Span | None, otel_context.Context]:
        """A request's span (None when its trace is not sampled) and the context to make current.

        An unsampled request still gets a context, with its caller's trace id or a new one and the
        sampled flag off, so that its logs name a trace id and what it sends on (a job, a batch)
        says "not sampled" and is not sampled again downstream."""
        parent = None
        if carrier:
            parent = extract(carrier)
            caller = trace.get_current_span(parent).get_span_context()
            if caller.is_valid and not caller.trace_flags.sampled:
                return None, parent
            if not caller.is_valid:
                parent = None  # no usable traceparent: a new trace, sampled at the ratio
        if parent is None and random.random() >= self.sample_ratio:
            unsampled = SpanContext(
                random.getrandbits(128) or 1, random.getrandbits(64) or 1, False, TraceFlags(TraceFlags.DEFAULT)
            )
            return None, trace.set_span_in_context(NonRecordingSpan(unsampled))
        attributes = {"http.request.method": method, "url.path": path, "url.scheme": scheme}
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes)
        return span, trace.set_span_in_context(span)

    def child(
        self,
        name: str,
        parent: SpanContext,
        *,
        start_ns: int | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        links: list[Link] | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> trace.Span:
        return self.tracer.start_span(
            name, context=as_parent(parent), kind=kind, links=links, attributes=attributes, start_time=start_ns
        )

    @contextmanager
    def producer(self, job_id: str) -> Iterator[dict[str, str]]:
        """A ``publish job`` span (under the current one, or a new trace) around publishing a job;
        yields the headers the message must carry for the worker to continue the trace."""
        attributes = {"messaging.system": "rabbitmq", "messaging.message.id": job_id}
        with self.tracer.start_as_current_span("publish job", kind=SpanKind.PRODUCER, attributes=attributes):
            yield current_headers()

    @contextmanager
    def consumer(self, name: str, headers: Mapping[str, Any], job_id: str | None) -> Iterator[trace.Span]:
        """A consumer span (``job`` in the worker, ``job result`` where results arrive), child of the
        context the message carries, current inside the block."""
        attributes = {"messaging.system": "rabbitmq", "messaging.message.id": job_id or ""}
        with self.tracer.start_as_current_span(
            name, context=extract(headers), kind=SpanKind.CONSUMER, attributes=attributes
        ) as span:
            yield span

    def job_result(self, headers: Mapping[str, Any] | None, job_id: str, status: str) -> None:
        """The last span of a job's trace, where its result lands (the API, or ``gateway ingest``)."""
        if headers:
            with self.consumer("job result", headers, job_id) as span:
                span.set_attribute("gateway.job.status", status)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter thread."""
        self.provider.shutdown()
