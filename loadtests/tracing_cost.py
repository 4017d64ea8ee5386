"""What the HTTP edge's request id, trace decision and metrics cost per request, in microseconds,
with tracing off, at a sample ratio, and at 100 %: ``RequestMiddleware`` around an app that
answers at once (no network, no decode), spans exported to a sink that drops them.

    python -m loadtests.tracing_cost --requests 50000 --repeat 3

The whole serving path's figures, tracing on and off side by side, come from
``python -m loadtests.serving_path --tracing 0.01,1``; this isolates the part tracing adds to
every request from the noise of a 2-core machine under load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from starlette.types import Message, Receive, Scope, Send

from service.http.middleware import RequestMiddleware
from service.metrics import Metrics
from service.tracing import Tracing, sampled_context


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def _answer(scope: Scope, receive: Receive, send: Send) -> None:
    sampled_context()  # what the classifier asks once per request
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    pass


def _scope() -> Scope:
    headers = [(b"host", b"gateway"), (b"content-type", b"image/jpeg"), (b"content-length", b"8000")]
    return {"type": "http", "method": "POST", "path": "/classify", "scheme": "http", "headers": headers}


async def _per_request_us(app: RequestMiddleware, requests: int) -> float:
    for _ in range(requests // 20):  # warm-up
        await app(_scope(), _receive, _send)
    start = time.perf_counter()
    for _ in range(requests):
        await app(_scope(), _receive, _send)
    return (time.perf_counter() - start) / requests * 1e6


async def run(ratios: list[float], requests: int, repeat: int) -> None:
    variants: dict[str, Tracing | None] = {"tracing off": None}
    for ratio in ratios:
        variants[f"tracing {ratio:g}"] = Tracing.create(None, "bench", ratio, role="gateway", exporter=_Drop())
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):  # interleaved
        for name, tracing in variants.items():
            results[name].append(await _per_request_us(RequestMiddleware(_answer, Metrics(), tracing), requests))
    off = statistics.median(results["tracing off"])
    print(f"\nRequestMiddleware per request, {requests:,} requests, median of {repeat} interleaved runs\n")
    print("| variant | us/request | added by tracing | each run |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        median = statistics.median(runs)
        print(f"| {name} | {median:.1f} | {median - off:+.1f} | {' '.join(f'{r:.1f}' for r in runs)} |")
    for tracing in variants.values():
        if tracing is not None:
            tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0.01,1", help="sample ratios to measure besides off")
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(run([float(r) for r in args.ratios.split(",") if r], args.requests, args.repeat))


if __name__ == "__main__":
    main()
