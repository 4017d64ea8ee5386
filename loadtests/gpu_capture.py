"""Why the compiled forward pass fails CUDA-graph capture in the torch backend, and what captures
it (issue 49, goal 3), on a machine with an NVIDIA GPU:

    python -m loadtests.gpu_capture [--batch 64] [--replays 200]

The torch backend compiles its forward pass (``GATEWAY_TORCH_COMPILE=on``), then captures it as one
CUDA graph per batch bucket. On an H100 every capture failed ("operation failed due to a previous
error during capture"), so the compiled backend ran without graphs. This probe compiles the pass
once, at one bucket, and tries to capture it in the ways that tell the causes apart, each printed
with its full error:

* ``as served``: what the backend does (``_capture_graphs`` on its own thread), with Dynamo's
  counters before and after (a guard that fails inside the capture recompiles there, which a
  capture forbids) and synchronising calls reported (``torch.cuda.set_sync_debug_mode``);
* ``global``, ``relaxed``: the same capture on this thread in each of CUDA's capture error modes
  (``relaxed`` lets calls that are unsafe during a capture through: if it captures, one such call
  was the cause);
* ``reduce-overhead``: ``torch.compile``'s own CUDA graphs (Inductor's graph trees) instead of ours;
* and the eager pass captured (the control), each that captured timed over ``--replays`` replays
  of one batch (CUDA events, median of 5 rounds) as images per second on one stream.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np


def _counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {name: dict(values) for name, values in copy.deepcopy(counters).items()}


def _changed(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for name, values in after.items():
        moved = {k: v - before.get(name, {}).get(k, 0) for k, v in values.items()}
        moved = {k: v for k, v in moved.items() if v}
        if moved:
            out[name] = moved
    return out


def _attempt(what: str, step: Callable[[], Any]) -> Any:
    """Run one attempt; print its outcome (with the whole error and Dynamo's counters that moved)."""
    before = _counters()
    started = time.perf_counter()
    try:
        result = step()
    except Exception as exc:
        print(f"[{what}] FAILED after {time.perf_counter() - started:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        result = None
    else:
        print(f"[{what}] ok in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"[{what}] Dynamo counters that moved: {_changed(before, _counters())}", flush=True)
    return result


def _replay_rate(replay: Callable[[], Any], batch: int, replays: int) -> float:
    """Images per second of ``replay`` (one batch each) on the current stream, median of 5 rounds."""
    import torch

    for _ in range(10):
        replay()
    torch.cuda.synchronize()
    rates = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        rates.append(batch * replays / (start.elapsed_time(end) / 1000))
    return float(np.median(rates))


def _capture(forward: Callable[[Any], Any], static: Any, mode: str) -> tuple[Any, Any]:
    """``forward(static)`` run once on a side stream, then captured in CUDA error mode ``mode``."""
    import torch

    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(stream):
        forward(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode=mode):
        out = forward(static)
    return graph, out


async def probe(batch: int, replays: int) -> None:
    import torch

    from service.backends.torch_backend import TorchBackend

    torch._logging.set_logs(recompiles=True, graph_breaks=True)  # type: ignore[attr-defined]
    backend = TorchBackend(
        None,
        device="cuda",
        max_batch_size=batch,
        max_concurrency=1,
        cuda_graphs=False,
        compile="on",
        bucket_sizes=[batch],  # one bucket: one compile
    )
    started = time.perf_counter()
    await backend.start()
    print(f"backend: {backend.detail} (compiled and warmed in {time.perf_counter() - started:.0f} s)", flush=True)
    loop = asyncio.get_running_loop()
    executor = backend._executor

    def as_served() -> None:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with backend._compiling():
                backend._capture_graphs()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if backend._graph_failures:
            raise RuntimeError(f"as served: {backend._graph_failures[-1]}")

    await loop.run_in_executor(executor, _attempt, "as served", as_served)
    with torch.inference_mode():
        static = torch.zeros((batch, 224, 224, 3), dtype=torch.uint8, device="cuda")
    rates: dict[str, float] = {}
    for mode in ("global", "relaxed"):

        def captured(mode: str = mode) -> None:
            with backend._compiling():
                graph, _ = _capture(backend._forward, static, mode)
            rates[f"compiled, our graph ({mode})"] = _replay_rate(graph.replay, batch, replays)

        await loop.run_in_executor(executor, _attempt, f"compiled, capture_error_mode={mode}", captured)

    def eager() -> None:
        graph, _ = _capture(backend._forward_eager, static, "thread_local")
        rates["eager, our graph"] = _replay_rate(graph.replay, batch, replays)

    await loop.run_in_executor(executor, _attempt, "eager pass captured (control)", eager)

    def compiled_no_graph() -> None:
        with torch.inference_mode():
            rates["compiled, no graph"] = _replay_rate(lambda: backend._forward(static), batch, replays)

    await loop.run_in_executor(executor, _attempt, "compiled, without a graph", compiled_no_graph)

    def reduce_overhead() -> None:
        compiled = torch.compile(backend._forward_eager, mode="reduce-overhead", dynamic=False, fullgraph=True)
        with torch.inference_mode(), backend._compiling():
            for _ in range(3):  # Inductor's graph trees record on the first calls, then replay
                compiled(static)
            rates["compiled, reduce-overhead"] = _replay_rate(lambda: compiled(static), batch, replays)

    await loop.run_in_executor(executor, _attempt, "torch.compile mode=reduce-overhead", reduce_overhead)
    await backend.aclose()
    print(f"\nbatch {batch}, one stream, {replays} replays x 5 (median):", flush=True)
    for what, rate in rates.items():
        print(f"  {what:<40} {rate:>10,.0f} img/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(probe(args.batch, args.replays))


if __name__ == "__main__":
    main()
