"""An API replica's job states for ``GET /jobs/{id}``: pending markers (with what a worker said
about why the job waits) and results, bounded in bytes and age (see ``service.jobs.client``)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace

from cachetools import TTLCache

from service.jobs.messages import JobNotice, JobResult

logger = logging.getLogger(__name__)

PENDING_BYTES = 200
"""What a pending marker costs, roughly (id, filename, the cache's own entry), besides its ``waiting``."""
WAITING_CHARS = 500
"""The longest ``waiting`` kept."""


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    filename: str | None
    waiting: str | None = None
    """Why it is not classified yet, when a worker said so (``JobNotice``)."""


def _result_bytes(result: JobResult) -> int:
    """What a result costs in the store: its JSON size is a fair proxy for the model's (~4-12 KB
    with top-5 labels and timings)."""
    return len(result.model_dump_json()) + sys.getsizeof(result.job_id)


class JobStore:
    """Job states by id: pending markers and results in two TTL caches bounded in bytes, so that a
    burst of results can never evict the markers of jobs still running."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self._pending: TTLCache[str, PendingJob] = TTLCache(
            maxsize=max(1, max_bytes // 4), ttl=ttl, getsizeof=lambda job: PENDING_BYTES + len(job.waiting or "")
        )
        self._results: TTLCache[str, JobResult] = TTLCache(maxsize=max_bytes, ttl=ttl, getsizeof=_result_bytes)

    def pending(self, job_id: str, filename: str | None) -> None:
        if job_id not in self._results:
            self._pending[job_id] = PendingJob(job_id, filename)

    def waiting(self, notice: JobNotice) -> None:
        """A worker says why the job is still waiting: kept on its pending marker (none once its
        result is in)."""
        pending = self._pending.get(notice.job_id)
        if pending is not None and pending.waiting != notice.waiting:  # put again: its size changes
            self._pending[notice.job_id] = replace(pending, waiting=notice.waiting[:WAITING_CHARS])

    def record(self, result: JobResult) -> None:
        """Keep the result; a late ``failed`` duplicate (at-least-once delivery) never replaces a
        ``done``."""
        known = self._results.get(result.job_id)
        if known is not None and known.status == "done" and result.status != "done":
            return
        try:
            self._results[result.job_id] = result
        except ValueError:  # larger than the whole store: keep nothing rather than fail
            logger.warning("jobs: result of %s is larger than GATEWAY_JOBS_CACHE_BYTES", result.job_id)
        self._pending.pop(result.job_id, None)

    def get(self, job_id: str) -> PendingJob | JobResult | None:
        return self._results.get(job_id) or self._pending.get(job_id)

    @property
    def bytes(self) -> int:
        return int(self._pending.currsize + self._results.currsize)

    def __len__(self) -> int:
        return len(self._pending) + len(self._results)
