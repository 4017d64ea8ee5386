"""A small OTLP/HTTP trace receiver on loopback: what the tests check spans in, and the sink the
tracing-cost benchmark exports to.

It speaks the real protocol (``POST /v1/traces``, an ``ExportTraceServiceRequest`` in protobuf or
JSON, optionally gzipped) and answers as a collector does, so the gateway's exporter and Triton's are
exercised exactly as in production. Spans are kept flattened as ``ReceivedSpan``.

``python -m loadtests.harness.otlp_receiver --port 4318`` runs it alone and prints a line per span.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _from_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON (what Triton's exporter sends): protobuf's JSON mapping, except that trace and
    span ids are hex, not base64."""
    document = json.loads(body)
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for name in _ID_FIELDS:
                        if item.get(name):
                            item[name] = base64.b64encode(bytes.fromhex(item[name])).decode()
    return json_format.ParseDict(document, ExportTraceServiceRequest(), ignore_unknown_fields=True)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    """Empty for a root span."""
    kind: str
    start_ns: int
    end_ns: int
    status: int
    """0 unset, 1 ok, 2 error."""
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    """(trace id, span id) of each linked span."""

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


class OTLPReceiver:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        on_span: Callable[[ReceivedSpan], None] | None = None,
        *,
        keep: bool = True,
    ):
        """``keep=False``: a sink that answers every export without decoding it (the benchmark's
        collector, so that its own CPU is spent on nothing but the socket)."""
        self.keep = keep
        self.bytes = 0
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.on_span = on_span
        self.requests = 0
        self.rejected: list[str] = []
        """Why each export that could not be decoded was refused (400)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_error(404)
                    return
                if not receiver.keep:
                    receiver.requests += 1
                    receiver.bytes += len(body)
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                try:
                    if self.headers.get("Content-Type", "").startswith("application/json"):
                        request = _from_json(body)
                    else:
                        request = ExportTraceServiceRequest()
                        request.ParseFromString(body)
                except Exception as exc:
                    with receiver._cond:
                        receiver.rejected.append(f"{type(exc).__name__}: {exc}"[:500])
                    self.send_error(400, "not an ExportTraceServiceRequest")
                    return
                receiver._add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """The base URL to configure an exporter with (spans go to ``/v1/traces`` under it)."""
        host, port = self.server.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=KINDS.get(span.kind, str(span.kind)),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            status=span.status.code,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        )
                    )
        with self._cond:
            self.requests += 1
            self._spans.extend(received)
            self._cond.notify_all()
        if self.on_span is not None:
            for one in received:
                self.on_span(one)

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        """Wait until ``predicate(spans)`` holds; return the spans (raise TimeoutError with them)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name, s.trace_id[-4:]) for s in self._spans})
                    raise TimeoutError(
                        f"spans received ({len(self._spans)}: {names}; exports refused: {self.rejected}) "
                        "never met the condition"
                    )
                self._cond.wait(left)
            return list(self._spans)

    async def until(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        """``wait_for`` without blocking the event loop (whose servers are producing the spans)."""
        return await asyncio.to_thread(self.wait_for, predicate, timeout)

    def start(self) -> OTLPReceiver:
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:  # pragma: no cover - manual use
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()

    def show(span: ReceivedSpan) -> None:
        parent = span.parent_id or "root"
        ms = (span.end_ns - span.start_ns) / 1e6
        print(f"{span.service:20} {span.trace_id[:8]} {parent[:8]:>8} -> {span.span_id[:8]} {span.name} {ms:.2f} ms")

    receiver = OTLPReceiver(args.host, args.port, on_span=show)
    print(f"OTLP receiver on {receiver.endpoint}/v1/traces", flush=True)
    receiver.server.serve_forever()


if __name__ == "__main__":  # pragma: no cover
    main()
