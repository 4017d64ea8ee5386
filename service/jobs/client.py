"""The API's side of offline mode: publish images as jobs, and learn every job's result.

Each API replica binds its own queue to the results exchange and so sees every result; it keeps
the latest ``jobs_cache_size`` job states in memory for ``GET /jobs/{id}``. A job is ``pending`` on
the replica that accepted it until its result arrives; other replicas answer 404 for it until then,
and every replica answers ``done``/``failed`` once the result is out (see the README).
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from service.jobs.broker import Broker
from service.jobs.messages import DEFAULT_REPLY_TO, JobResult, new_job_id, request_message
from service.jobs.topology import REQUEST_KEY, Names
from service.metrics import Metrics
from service.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class PendingJob:
    job_id: str
    filename: str | None


class JobStore:
    """Bounded, oldest-forgotten-first map of job id to its pending marker or result."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._jobs: OrderedDict[str, PendingJob | JobResult] = OrderedDict()

    def _put(self, job_id: str, state: PendingJob | JobResult) -> None:
        self._jobs[job_id] = state
        self._jobs.move_to_end(job_id)
        while len(self._jobs) > self.capacity:
            self._jobs.popitem(last=False)

    def pending(self, job_id: str, filename: str | None) -> None:
        if job_id not in self._jobs:
            self._put(job_id, PendingJob(job_id, filename))

    def record(self, result: JobResult) -> None:
        self._put(result.job_id, result)

    def get(self, job_id: str) -> PendingJob | JobResult | None:
        return self._jobs.get(job_id)

    def __len__(self) -> int:
        return len(self._jobs)


@dataclass(frozen=True)
class OfflineImage:
    data: bytes
    content_type: str
    filename: str | None


class JobsClient:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        assert settings.broker_url
        self.store = JobStore(settings.jobs_cache_size)
        self.metrics = metrics
        self.names = Names(settings.queue_prefix)
        self.listen_queue = f"{self.names.prefix}.api.{uuid.uuid4().hex[:12]}"
        self.broker = Broker(
            settings.broker_url, self.names, publish_timeout=settings.publish_timeout, on_connect=self._listen
        )

    async def _listen(self, broker: Broker) -> None:
        assert broker.channel is not None
        assert broker.topology is not None
        queue = await broker.channel.declare_queue(self.listen_queue, exclusive=True, auto_delete=True)
        await queue.bind(broker.topology.results_exchange, "#")
        await queue.consume(self._on_result, no_ack=True)

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        try:
            self.store.record(JobResult.model_validate_json(message.body))
        except ValidationError as exc:
            logger.warning("jobs: ignoring a malformed result message: %s", exc)

    def start(self) -> None:
        self.broker.start()

    def status(self) -> str:
        return self.broker.status()

    async def submit(self, images: list[OfflineImage], top_k: int) -> list[str]:
        """Publish each image (confirmed) and return the job ids, in order."""
        assert all(i.data for i in images)
        job_ids = []
        for image in images:
            job_id = new_job_id()
            message = request_message(
                image.data,
                job_id=job_id,
                content_type=image.content_type,
                filename=image.filename,
                top_k=top_k,
                reply_to=DEFAULT_REPLY_TO,
            )
            await self.broker.publish("requests", message, REQUEST_KEY)
            self.metrics.queue_messages.labels("published").inc()
            self.store.pending(job_id, image.filename)
            job_ids.append(job_id)
        return job_ids

    async def aclose(self) -> None:
        await self.broker.aclose()
