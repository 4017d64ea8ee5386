from __future__ import annotations

import time

from service.jobs.messages import JobNotice, JobResult
from service.jobs.store import WAITING_CHARS, JobStore, PendingJob
from service.schemas import Label
from service.settings.values import redact


def _result(job_id: str, status: str = "done", labels: int = 5) -> JobResult:
    return JobResult(
        job_id=job_id,
        status=status,  # type: ignore[arg-type]
        labels=[Label(index=i, label=f"class number {i}", score=0.1) for i in range(labels)],
        timings={"queued": 0.01, "processing": 0.02},
    )


def test_store_is_bounded_in_bytes() -> None:
    """Results fill at most the byte budget, oldest forgotten first, however many there are."""
    store = JobStore(max_bytes=1024 * 1024, ttl=3600)
    for i in range(5000):
        store.record(_result(f"job-{i}"))
    assert store.bytes <= 1024 * 1024 + 1024 * 1024 // 4
    assert store.get("job-0") is None
    assert isinstance(store.get("job-4999"), JobResult)


def test_results_never_evict_pending_jobs() -> None:
    store = JobStore(max_bytes=1024 * 1024, ttl=3600)
    store.pending("mine", "a.jpg")
    for i in range(5000):  # another flood of results (other replicas' jobs, say)
        store.record(_result(f"other-{i}"))
    assert isinstance(store.get("mine"), PendingJob)


def test_states_expire() -> None:
    store = JobStore(max_bytes=1024 * 1024, ttl=0.05)
    store.pending("p", None)
    store.record(_result("r"))
    time.sleep(0.1)
    assert store.get("p") is None
    assert store.get("r") is None


def test_a_failed_duplicate_never_overwrites_done() -> None:
    """At-least-once delivery: a job may be classified, then fail on a redelivery."""
    store = JobStore(max_bytes=1024 * 1024, ttl=3600)
    store.pending("j", None)
    store.record(_result("j"))
    store.record(_result("j", status="failed", labels=0))
    state = store.get("j")
    assert isinstance(state, JobResult)
    assert state.status == "done"
    store.record(_result("f", status="failed", labels=0))
    store.record(_result("f"))  # a later success does replace a failure
    assert store.get("f").status == "done"  # type: ignore[union-attr]


def test_a_late_pending_marker_does_not_hide_a_result() -> None:
    """A fast worker's result may arrive before the API records the job as pending."""
    store = JobStore(max_bytes=1024 * 1024, ttl=3600)
    store.record(JobResult(job_id="fast", status="done"))
    store.pending("fast", None)
    assert isinstance(store.get("fast"), JobResult)


def test_broker_urls_are_redacted() -> None:
    assert redact("amqp://gateway:s3cret@rabbit:5672/prod") == "amqp://gateway:***@rabbit:5672/prod"
    assert redact("amqp://rabbit:5672/") == "amqp://rabbit:5672/"


def test_a_pending_job_keeps_what_a_worker_said_until_its_result() -> None:
    """A worker's notice is kept on the job's pending marker (cut to ``WAITING_CHARS``), counted in
    the store's bytes; a notice for a job not pending here is ignored; the result replaces both."""
    store = JobStore(max_bytes=1024 * 1024, ttl=3600)
    store.pending("mine", None)
    before = store.bytes
    store.waiting(JobNotice(job_id="mine", waiting="no worker serves model 'x'" + "!" * 1000))
    store.waiting(JobNotice(job_id="elsewhere", waiting="no worker serves model 'x'"))
    pending = store.get("mine")
    assert isinstance(pending, PendingJob)
    assert pending.waiting is not None
    assert pending.waiting.startswith("no worker serves model 'x'")
    assert len(pending.waiting) == WAITING_CHARS
    assert store.bytes == before + WAITING_CHARS
    assert store.get("elsewhere") is None
    store.record(_result("mine"))
    assert isinstance(store.get("mine"), JobResult)
