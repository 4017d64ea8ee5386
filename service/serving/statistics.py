"""A model version's inference statistics, in the shape of the Open Inference Protocol's
statistics extension (Triton's ``/v2/models/{name}/stats`` and gRPC ``ModelStatistics``): what
``perf_analyzer`` and Triton's other clients read to split a request's time into queue and compute.

Counted where every online inference passes, whatever front it came by (``/classify``, the models'
``classify`` and ``embed`` routes, the v2 REST and gRPC fronts): per request in
``ServedModels.hold`` (its admission, load wait, decode, queue, inference and answer), per backend
batch in the batcher's report. Plain integer adds on the event loop (no lock: one thread touches
them); the offline worker's inferences, which run in their own processes, are not counted here.

Counts are per request for ``success`` and ``fail``, per image for ``queue`` and ``compute_infer``
(the batcher's unit: a request of 3 images is 3 items of the queue, as Triton counts each request
of a batch), per backend batch in ``batch_stats``. The backend's call (laying the batch out, moving
it, inferring, copying the scores back) is ``compute_infer``: the gateway does not time its parts,
so ``compute_input`` and ``compute_output`` take no time, counted as often as ``compute_infer`` (as
Triton counts them: ``perf_analyzer`` aborts, "Server side statistics compute counts must be the
same.", when the three counts differ); the cache's stay at zero (there is none).
Each worker process keeps its own: with several uvicorn workers, each answers for itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from service.batching.items import BatchReport

NS = 1_000_000_000

ZERO: dict[str, int] = {"count": 0, "ns": 0}
"""A duration nothing was counted in (copied where it is answered)."""


class VersionStatistics:
    """One model version's counters since it was made (a reload's replacement starts at zero)."""

    __slots__ = (
        "batches",
        "execution_count",
        "fail_count",
        "fail_ns",
        "infer_count",
        "infer_ns",
        "inference_count",
        "last_inference",
        "queue_count",
        "queue_ns",
        "success_count",
        "success_ns",
    )

    def __init__(self) -> None:
        self.success_count = 0
        self.success_ns = 0
        self.fail_count = 0
        self.fail_ns = 0
        self.queue_count = 0
        """Images that waited in the batcher's queue (those of batches that succeeded)."""
        self.queue_ns = 0
        self.infer_count = 0
        """Images inferred: each counts its batch's backend time, as Triton counts each request of a batch."""
        self.infer_ns = 0
        self.inference_count = 0
        """Images inferred by batches that succeeded."""
        self.execution_count = 0
        """Backend batches that succeeded."""
        self.last_inference = 0
        """When the latest request ended, in milliseconds since the epoch (0: none yet)."""
        self.batches: dict[int, list[int]] = {}
        """Per batch size, the batches that succeeded and their backend time: [count, ns]."""

    def request(self, ok: bool, ns: int) -> None:
        """A request of this version ended (``ok``: answered; else refused, failed or cancelled)
        after ``ns`` nanoseconds."""
        if ok:
            self.success_count += 1
            self.success_ns += ns
        else:
            self.fail_count += 1
            self.fail_ns += ns
        self.last_inference = time.time_ns() // 1_000_000

    def observe_batch(self, report: BatchReport) -> None:
        """The batcher's report of one backend batch (``DynamicBatcher``'s ``on_batch``)."""
        if report.error is not None:
            return  # its requests are counted failed
        size = report.size
        ns = int(report.backend_seconds * NS)
        self.inference_count += size
        self.execution_count += 1
        self.queue_count += size
        self.queue_ns += int(sum(report.queue_waits) * NS)
        self.infer_count += size
        self.infer_ns += ns * size
        at = self.batches.get(size)
        if at is None:
            self.batches[size] = [1, ns]
        else:
            at[0] += 1
            at[1] += ns

    def as_dict(self, name: str, version: str) -> dict[str, Any]:
        """The statistics extension's ``ModelStatistics`` for this version (JSON, as Triton's REST
        answers it, and what ``json_format.ParseDict`` takes into the gRPC message)."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": {"count": self.success_count, "ns": self.success_ns},
                "fail": {"count": self.fail_count, "ns": self.fail_ns},
                "queue": {"count": self.queue_count, "ns": self.queue_ns},
                "compute_input": {"count": self.infer_count, "ns": 0},
                "compute_infer": {"count": self.infer_count, "ns": self.infer_ns},
                "compute_output": {"count": self.infer_count, "ns": 0},
                "cache_hit": dict(ZERO),
                "cache_miss": dict(ZERO),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": count, "ns": 0},
                    "compute_infer": {"count": count, "ns": ns},
                    "compute_output": {"count": count, "ns": 0},
                }
                for size, (count, ns) in sorted(self.batches.items())
            ],
        }


def both(first: Callable[[BatchReport], None], second: Callable[[BatchReport], None]) -> Callable[[BatchReport], None]:
    """One ``on_batch`` for the batcher that calls two observers (its metrics, its statistics)."""

    def observe(report: BatchReport) -> None:
        first(report)
        second(report)

    return observe
