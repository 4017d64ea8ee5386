"""The API's side of offline mode: publish images as jobs, and learn the results of its jobs.

Each API replica binds a queue of its own to the results exchange for the API's routing key only
(``jobs``: never the results of ``gateway ingest`` runs), and to the notices exchange for the
same key (a worker's word on why a job still waits: ``waiting``), and keeps job states in memory
for ``GET /jobs/{id}``, bounded in bytes and age. A job is ``pending`` on the replica that accepted it
until its result arrives; other replicas answer 404 for it until then, and every replica answers
``done``/``failed`` once the result is out (see docs/offline.md).

The replica's queue is not exclusive: it outlives a broker reconnect (an exclusive queue is deleted
with its connection, losing the results published meanwhile, so jobs stayed ``pending`` for ever),
the robust channel declares and consumes it again, and RabbitMQ deletes it (``x-expires``) once no
replica has used it for ``RESULTS_QUEUE_EXPIRES_MS``. It is a quorum queue, so that it also outlives
the loss of a cluster node: the replica fails over to another node and finds its results there.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from service.errors import BackendUnavailable, BadRequest, GatewayError
from service.jobs.broker import Broker
from service.jobs.idempotency import HOLD_TIMEOUTS, MAX_IMAGES, IdempotencyLog, fingerprint, key_digest
from service.jobs.messages import DEFAULT_REPLY_TO, WAITING_TYPE, JobNotice, JobResult, request_message
from service.jobs.owners import derived_job_ids, fresh_job_id, owns
from service.jobs.store import JobStore, PendingJob
from service.jobs.topology import REQUEST_KEY, Names, Route
from service.metrics import Metrics
from service.settings import Settings
from service.tracing import Tracing, publishing

logger = logging.getLogger(__name__)

RESULTS_QUEUE_EXPIRES_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class OfflineImage:
    data: bytes
    content_type: str
    filename: str | None


@dataclass(frozen=True)
class JobTarget:
    """The model (its queue) and version a submit's jobs are for."""

    route: Route
    version: str | None = None
    """None: the worker picks one by the model's traffic weights."""

    @property
    def fingerprint(self) -> str:
        """What the idempotency fingerprint takes of it: nothing for the default model (its route's
        key is the one of the versions that served one model) at a version the workers pick, so
        that the keys of submits made before models existed replay."""
        if self.route.key == REQUEST_KEY and self.version is None:
            return ""
        return f"{self.route.model}\0{self.version or ''}"


DEFAULT_TARGET = JobTarget(Route("", "", REQUEST_KEY))
"""The default model's queue, without naming the model (as submits of earlier versions did)."""


@dataclass(frozen=True)
class Submitted:
    job_ids: list[str]
    replayed: bool = False
    """An earlier submit with the same idempotency key had published every image: nothing new was."""


class IdempotencyConflict(GatewayError):
    """409: the idempotency key was used before with another body."""

    status_code = 409
    error = "idempotency_conflict"


def _conflict() -> IdempotencyConflict:
    return IdempotencyConflict(
        "this Idempotency-Key was used with a different request (images, filenames, top_k or Webhook-URL); "
        "use a new key for a new request"
    )


def _raise_first(outcomes: list[BaseException | None]) -> None:
    error = next((outcome for outcome in outcomes if outcome is not None), None)
    if error is not None:
        raise error


class JobsClient:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tracing: Tracing | None = None,
        owners: Mapping[str, bytes] | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        """``routes``: the work queues of the models besides the default's (declared at connect, so
        that a job for any of them is routable)."""
        assert settings.broker_url
        self.tracing = tracing
        self.store = JobStore(settings.jobs_cache_bytes, settings.jobs_ttl)
        self.metrics = metrics
        self.names = Names(settings.queue_prefix)
        self.listen_queue = f"{self.names.prefix}.api.{uuid.uuid4().hex[:12]}"
        self.publish_timeout = settings.publish_timeout
        self.idempotency = IdempotencyLog(
            self.names,
            settings.idempotency_ttl,
            settings.idempotency_max_bytes,
            hold=HOLD_TIMEOUTS * settings.publish_timeout,
        )
        self._settling: set[asyncio.Task[None]] = set()
        """Outcomes being appended to the claims stream."""
        self.owners = dict(owners or {})
        """API key id to the key, under which its job ids are made (``service.jobs.owners``)."""
        self.broker = Broker(
            settings.broker_url,
            self.names,
            publish_timeout=settings.publish_timeout,
            on_connect=self._listen,
            name=self.listen_queue,
            routes=routes,
        )

    async def _listen(self, broker: Broker) -> None:
        assert broker.channel is not None
        assert broker.topology is not None
        # A quorum queue: on a cluster, a classic queue dies with its node, and the results
        # published while this replica moves to another node would be lost to it
        queue = await broker.channel.declare_queue(
            self.listen_queue, durable=True, arguments={"x-queue-type": "quorum", "x-expires": RESULTS_QUEUE_EXPIRES_MS}
        )
        await queue.bind(broker.topology.results_exchange, DEFAULT_REPLY_TO)
        await queue.bind(broker.topology.notices_exchange, DEFAULT_REPLY_TO)
        await queue.consume(self._on_result, no_ack=True)
        assert broker.connection is not None
        await self.idempotency.follow(broker.connection)

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        if message.type == WAITING_TYPE:
            try:
                self.store.waiting(JobNotice.model_validate_json(message.body))
            except ValidationError as exc:
                logger.warning("jobs: ignoring a malformed notice: %s", exc)
            return
        try:
            result = JobResult.model_validate_json(message.body)
        except ValidationError as exc:
            logger.warning("jobs: ignoring a malformed result message: %s", exc)
            return
        self.store.record(result)
        if self.tracing is not None:
            self.tracing.job_result(message.headers, result.job_id, result.status)

    def start(self) -> None:
        self.broker.start()

    def status(self) -> str:
        return self.broker.status()

    def claims_status(self) -> tuple[str, bool]:
        """The idempotency check of /readyz, and whether it makes the replica unready: while
        connected and still reading the claims stream up to its end (at start, and again after a
        reconnect), an idempotent submit here would wait behind that backlog and time out (503).
        Without the broker it is the broker's check that says so, and online requests go on."""
        if not self.broker.is_open:
            return "waiting for the broker", False
        behind = self.idempotency.behind()
        return (behind, True) if behind is not None else ("ok", False)

    def _secret(self, owner: str) -> bytes:
        return self.owners[owner] if owner else b""

    def job(self, job_id: str, owner: str = "") -> PendingJob | JobResult | None:
        """The state of a job, for its owner only (the API key id that submitted it, "" without
        keys): any other key gets None, as for a job never submitted. Without API keys every
        caller is the same owner, and a job id is all it takes."""
        if self.owners and not owns(self._secret(owner), job_id):
            return None
        return self.store.get(job_id)

    async def submit(
        self,
        images: list[OfflineImage],
        top_k: int,
        *,
        owner: str = "",
        key: str | None = None,
        webhook: str | None = None,
        target: JobTarget = DEFAULT_TARGET,
    ) -> Submitted:
        """Publish each image (confirmed) and return the job ids, in order; the ids are
        ``owner``'s (an API key id, "" without keys). With an idempotency ``key``, ids are
        derived from the key and the request, and each image is queued once, whichever replica
        takes a retry (``service.jobs.idempotency``). With ``webhook``, each job's result is POSTed
        there when it finishes (``service.jobs.webhooks``). The jobs go to ``target``'s queue."""
        assert all(i.data for i in images)
        secret = self._secret(owner)
        if key is None:
            ids = [fresh_job_id(secret) for _ in images]
            _raise_first(await self._publish_all(images, ids, range(len(images)), top_k, webhook, target))
            return Submitted(ids)
        if len(images) > MAX_IMAGES:  # only where GATEWAY_MAX_IMAGES_PER_REQUEST allows more
            raise BadRequest(f"{len(images)} images; an idempotent submit takes at most {MAX_IMAGES}")
        body = fingerprint([(i.data, i.content_type, i.filename) for i in images], top_k, webhook, target.fingerprint)
        ids = derived_job_ids(secret, key, body, len(images))
        slot = key_digest(secret, key)
        async with self.idempotency.lock(slot):
            return await self._submit_once(images, ids, slot, body, top_k, webhook, target)

    async def _submit_once(
        self,
        images: list[OfflineImage],
        ids: list[str],
        slot: bytes,
        body: bytes,
        top_k: int,
        webhook: str | None,
        target: JobTarget,
    ) -> Submitted:
        """Claim the key through the stream; publish if this claim wins, else wait for the one that
        did and answer from its outcome (claiming again if it left images unconfirmed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.idempotency.hold + 2 * self.publish_timeout
        while True:
            known = self.idempotency.get(slot)
            if known is not None and known.fingerprint != body:
                raise _conflict()
            if known is not None and known.complete:
                return Submitted(ids, replayed=True)
            claim, decision = await self.idempotency.claim(
                self._append, slot, body, len(images), timeout=self.publish_timeout
            )
            if decision.verdict == "conflict":
                raise _conflict()
            if decision.verdict == "replay":
                return Submitted(ids, replayed=True)
            if decision.verdict == "publish":
                return await self._publish_claimed(
                    images, ids, slot, body, claim, decision.published, top_k, webhook, target
                )
            left = deadline - loop.time()
            if left <= 0:
                raise BackendUnavailable(
                    "a submit with this Idempotency-Key is still in progress on another replica; "
                    "retry with the same key"
                )
            if self.idempotency.holding(slot, decision):
                await self.idempotency.released(slot, min(left, max(0.01, decision.until - time.time())))

    async def _publish_claimed(
        self,
        images: list[OfflineImage],
        ids: list[str],
        slot: bytes,
        body: bytes,
        claim: bytes,
        done: int,
        top_k: int,
        webhook: str | None,
        target: JobTarget,
    ) -> Submitted:
        todo = [index for index in range(len(images)) if not done >> index & 1]
        published = 0
        try:
            outcomes = await self._publish_all(images, ids, todo, top_k, webhook, target)
            for index, outcome in zip(todo, outcomes, strict=True):
                if outcome is None:
                    published |= 1 << index
            _raise_first(outcomes)
        finally:
            self.idempotency.confirmed(slot, body, published)
            self._settle(self.idempotency.message("outcome", slot, claim, body, len(images), published))
        return Submitted(ids, replayed=not todo)

    async def _publish_all(
        self,
        images: list[OfflineImage],
        ids: list[str],
        indices: Sequence[int],
        top_k: int,
        webhook: str | None,
        target: JobTarget,
    ) -> list[BaseException | None]:
        """Publish together (the confirms overlap instead of costing a round trip each); each
        image's outcome, None where the broker confirmed it."""
        outcomes = await asyncio.gather(
            *(self._publish(images[i], ids[i], top_k, webhook, target) for i in indices), return_exceptions=True
        )
        return [outcome if isinstance(outcome, BaseException) else None for outcome in outcomes]

    async def _publish(
        self, image: OfflineImage, job_id: str, top_k: int, webhook: str | None, target: JobTarget
    ) -> None:
        with publishing(self.tracing, job_id) as trace:
            message = request_message(
                image.data,
                job_id=job_id,
                content_type=image.content_type,
                filename=image.filename,
                top_k=top_k,
                reply_to=DEFAULT_REPLY_TO,
                trace=trace,
                webhook=webhook,
                model=target.route.model or None,
                version=target.version,
            )
            await self.broker.publish("requests", message, target.route.key)
        self.metrics.queue_events["published"].inc()
        self.store.pending(job_id, image.filename)

    async def _append(self, message: aio_pika.Message) -> None:
        await self.broker.publish("queue", message, self.idempotency.stream)

    def _settle(self, message: aio_pika.Message) -> None:
        """Append the outcome that releases the key, without waiting for its confirm: the answer
        does not depend on it (a retry that meets the key still held waits for the outcome, which
        was sent first). If the broker fails now, the jobs are published anyway; the key stays held
        until its hold ends, and a retry after that publishes them again, under the same ids."""
        task = asyncio.create_task(self._append_outcome(message), name="idempotency-outcome")
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _append_outcome(self, message: aio_pika.Message) -> None:
        try:
            await self._append(message)
        except BackendUnavailable as exc:
            logger.warning("jobs: idempotency outcome not appended to the stream: %s", exc.detail)

    async def aclose(self) -> None:
        await asyncio.gather(*self._settling)  # each within the publish timeout
        await self.idempotency.aclose()
        await self.broker.aclose()
