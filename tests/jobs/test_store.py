from __future__ import annotations

from service.jobs.broker import redact
from service.jobs.client import JobStore, PendingJob
from service.jobs.messages import JobResult


def test_store_forgets_the_oldest_beyond_capacity() -> None:
    store = JobStore(capacity=3)
    for i in range(3):
        store.pending(f"job-{i}", None)
    store.record(JobResult(job_id="job-0", status="done"))  # a result refreshes its job
    store.pending("job-3", "x.jpg")
    assert len(store) == 3
    assert store.get("job-1") is None  # the oldest untouched entry went first
    assert isinstance(store.get("job-0"), JobResult)
    assert isinstance(store.get("job-3"), PendingJob)


def test_a_late_pending_marker_does_not_hide_a_result() -> None:
    """A fast worker's result may arrive before the API records the job as pending."""
    store = JobStore(capacity=10)
    store.record(JobResult(job_id="fast", status="done"))
    store.pending("fast", None)
    assert isinstance(store.get("fast"), JobResult)


def test_broker_urls_are_redacted() -> None:
    assert redact("amqp://gateway:s3cret@rabbit:5672/prod") == "amqp://gateway:***@rabbit:5672/prod"
    assert redact("amqp://rabbit:5672/") == "amqp://rabbit:5672/"
