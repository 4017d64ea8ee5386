"""``gateway worker``: consume images from RabbitMQ, classify them in batches, publish results.

Delivery is at least once: an input is acknowledged only after its result is confirmed by the
broker, so a worker killed at any point loses nothing (its unacknowledged messages go back to the
queue). Acks go out with ``multiple=True`` where the order allows (``service.jobs.acks``): one frame
for a run of finished messages. Outcomes per message:

* classified -> result ``done`` published (its ``top_k`` best labels, or a model's ``embedding``)
  and, when the submit gave a ``Webhook-URL``, its delivery to ``<prefix>.webhooks``
  (``service.jobs.webhooks``), input acked;
* bad input (undecodable, too large, not an image, bad headers: of the wrong type, or a number out
  of its range, ``service.jobs.headers``) -> result ``failed`` published, the message copied to the
  dead-letter exchange with the reason in ``x-gateway-error`` / ``x-gateway-detail``, input acked:
  dead-lettered once, never redelivered in a loop;
* backend failure -> republished with ``x-retries`` + 1 (then acked) up to ``max_retries``, then
  dead-lettered like bad input;
* overload or outage (queue full, batch deadline passed, backend unavailable) -> republished after
  a backoff with ``x-requeues`` + 1, then acked: neither a retry nor a delivery is used up;
* a job for a model this worker does not serve, whose queue is another (the default model changed
  while it waited) -> republished to its model's queue at once (``rerouted``), then acked;
* a job for a model or version this worker does not serve, on the right queue (the API's models
  changed before the workers' in a rolling update; another worker may serve it) -> requeued like
  overload, up to ``NOT_SERVED_REQUEUES`` times (about 7 minutes), then failed and dead-lettered as
  ``model_not_served``;
* the broker does not take an outcome (a publish nacked, returned as unroutable, not confirmed
  within ``publish_timeout``, or no connection) -> that publish is tried again after a backoff
  (0.5 s, doubling, at most 30 s, with jitter; ``publish_retried`` counts them), for as long as the
  input's channel lives, and the input stays unacked meanwhile. Broker trouble is not the job's
  fault, so it uses up no delivery: rejecting the input with requeue, as earlier versions did,
  counted one against the quorum queue's delivery limit per refusal, and after about
  ``queue_delivery_limit`` refusals good jobs were dead-lettered (``delivery_limit``) without a
  result. Messages held this way fill the prefetch window, so a worker takes no new work while the
  broker refuses its outcomes; it has nothing to do with it anyway;
* the input's channel closes while its outcome is retried (connection lost; RabbitMQ's consumer
  timeout, 30 min by default, for a refusal that long) -> nothing more is done with it: the broker
  redelivers it. A quorum queue counts that return as a delivery, like a crash; a job would need
  ``queue_delivery_limit`` channel losses while held to be dead-lettered for them, which we accept;
* on shutdown, outcomes still being retried keep trying until the drain timeout
  (``request_timeout``), then are abandoned and the broker redelivers them (one delivery used);
* anything else that escapes (an error in an error path) -> the input is rejected with requeue, so
  nothing is stranded;
* the worker crashes or hangs for good (OOM, a codec fault) -> the broker redelivers; the quorum
  queue's delivery limit (a policy, see ``service.jobs.policies``) dead-letters a message that
  keeps doing it, with reason ``delivery_limit``.

Each model a worker serves (``worker_models``) has its own queue (``service.jobs.topology``; the
default model two): a job is classified by the model its ``x-model`` header names (absent: the
model of the queue it came from), at the version ``x-model-version`` names (absent: one picked by
the model's traffic weights), and retried or requeued to the same queue. Its headers are read and
checked before anything else (``service.jobs.headers``), so that every copy of it (a retry, a
requeue, a move) carries what it asked for; the copies are published by ``service.jobs.outcomes``.

Every batch has a deadline (``request_timeout``), and the event loop touches a heartbeat file
(``worker_heartbeat_file``) that ``gateway alive`` checks: a stuck loop cannot fake it.

Each message is handled under its job id (on every log line) and, with tracing on, a ``job`` span
continuing the trace its headers carry; the result carries that span's context on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import aiormq
from aio_pika.abc import AbstractIncomingMessage

from service.backends.base import Backend
from service.classifier import Classifier, ImageInput
from service.errors import (
    BackendUnavailable,
    BadImage,
    BadRequest,
    DeadlineExceeded,
    GatewayError,
    PayloadTooLarge,
    QueueFull,
    UnsupportedMediaType,
)
from service.jobs import headers as job_headers
from service.jobs.acks import Acks
from service.jobs.assignment import (
    NOT_SERVED_REQUEUES,
    Misrouted,
    NotServedHere,
    assignment,
    not_served_notice,
    resolve,
    worker_catalog,
)
from service.jobs.broker import Broker
from service.jobs.exposition import serve_metrics
from service.jobs.headers import JobHeaders
from service.jobs.messages import DEFAULT_REPLY_TO, JobResult, new_job_id, published_at
from service.jobs.outcomes import ChannelLost, Outcomes, mark
from service.jobs.topology import Names, Route
from service.jobs.upkeep import HEARTBEAT_INTERVAL, IngestQueues, heartbeat, migrate_legacy_queue, sample_depth
from service.jobs.upkeep import heartbeat_age as heartbeat_age  # for ``gateway alive``
from service.jobs.webhooks import WebhookSender
from service.logs import JOB_ID
from service.metrics import Metrics
from service.schemas import Label, ModelInfo
from service.serving.catalog import Catalog, load_catalog
from service.serving.pipeline import open_models
from service.serving.registry import ServedModels
from service.settings import Settings
from service.tracing import Tracing

logger = logging.getLogger(__name__)


class DeliveryLimit(GatewayError):
    """The job was delivered to workers that all died or hung while holding it."""

    status_code = 500
    error = "delivery_limit"


POISON = (BadImage, BadRequest, PayloadTooLarge, UnsupportedMediaType, DeliveryLimit)
OVERLOAD_PAUSE = 0.5
"""Seconds before the first requeue of a job refused for overload; doubled at each requeue."""
OVERLOAD_PAUSE_MAX = 30.0
BROKER_CALLS_TIMEOUT = 15.0
"""Seconds the background broker calls get to finish at shutdown."""


class Worker:
    def __init__(
        self,
        settings: Settings,
        models: ServedModels,
        routes: list[Route],
        broker: Broker,
        metrics: Metrics,
        tracing: Tracing | None = None,
        known: Mapping[str, Route] | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = tracing
        self.models = models
        """The models it serves (each one's versions by traffic weight)."""
        self.routes = routes
        """Their queues, each consumed."""
        self.known = dict(known or {})
        self.ingest = IngestQueues(broker.names)
        """The ingest runs' results queues of the jobs it handled (their depth is sampled)."""
        """The queue of every model the gateway serves (the ones served here, and the others)."""
        self.broker = broker
        self.metrics = metrics
        self.outcomes = Outcomes(broker, metrics)
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self._tasks: set[asyncio.Task[Any]] = set()
        self._acks = Acks()
        self._consumers: dict[str, str] = {}
        """Consumer tags by queue."""
        self._suspects = asyncio.Lock()
        """Redelivered messages (their worker died holding them) run one at a time, alone."""
        self.closing = False

    async def start(self) -> None:
        assert self.broker.topology is not None
        self._acks.start()
        for route in self.routes:
            queue = self.broker.topology.work_queues[route.queue]
            self._consumers[route.queue] = await queue.consume(partial(self._on_message, route))
            logger.info(
                "worker %s: consuming %s for model %s (prefetch %d)",
                self.name,
                route.queue,
                route.model,
                self.broker.prefetch,
            )

    async def _on_message(self, route: Route, message: AbstractIncomingMessage) -> None:
        """Runs in the task aio-pika starts for each delivery (no task of our own on top)."""
        self.metrics.queue_events["consumed"].inc()
        try:
            self._acks.received(message)
        except aiormq.exceptions.ChannelInvalidStateError:
            return  # its channel is already gone: the broker redelivers it
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handle(message, route)
        finally:
            self._tasks.discard(task)

    async def _requeue_later(
        self, message: AbstractIncomingMessage, job: JobHeaders, route: Route, error: GatewayError
    ) -> None:
        """Overload or an outage is not the message's fault: wait (backing off with each requeue),
        then put a copy back at the tail with the same retry count; this one is acked. Neither a
        retry nor a delivery of the quorum queue's delivery limit is used up."""
        pause = min(OVERLOAD_PAUSE * 2 ** min(job.requeues, 16), OVERLOAD_PAUSE_MAX) * random.uniform(0.5, 1.0)
        logger.warning(
            "worker: job %s not run (%s: %s); requeued in %.1f s", message.message_id, error.error, error.detail, pause
        )
        mark("requeued", error)
        if not self.closing:
            await asyncio.sleep(pause)
        await self.outcomes.republish(message, job, route, retries=job.retries, requeues=job.requeues + 1)
        self.metrics.queue_events["requeued"].inc()

    async def _handle(self, message: AbstractIncomingMessage, route: Route) -> None:
        """Every path ends in an ack or a reject: acked (with others: ``service.jobs.acks``) once its
        outcome is confirmed; rejected with requeue when an error escapes (an error inside an error
        path), so the prefetch window never fills with stranded messages. A publish the broker does
        not take is retried in place (``Outcomes.publish``); only a lost channel ends a message
        unsettled, and the broker then redelivers it."""
        JOB_ID.set(message.message_id)  # this task's own context: every line it logs names the job
        if self.tracing is None:
            await self._settle(message, route)
            return
        with self.tracing.consumer("job", message.headers or {}, message.message_id):
            await self._settle(message, route)

    async def _settle(self, message: AbstractIncomingMessage, route: Route) -> None:
        try:
            if not job_headers.delivered_before(message.headers or {}):
                await self._process(message, route)
            else:  # it may be what killed the last worker: keep it out of others' batches
                async with self._suspects:
                    await self._process(message, route)
        except ChannelLost as exc:
            logger.warning("worker: job %s: its channel closed (%s); the broker redelivers it", message.message_id, exc)
        except Exception:
            logger.exception("worker: job %s could not be finished; requeued", message.message_id)
            self.metrics.queue_events["rejected"].inc()
            self._acks.reject(message, requeue=True)
        else:
            self._acks.finished(message)

    async def _process(self, message: AbstractIncomingMessage, route: Route) -> None:
        started = time.perf_counter()
        self.ingest.saw(message.reply_to)
        headers = message.headers or {}
        job_id = message.message_id or new_job_id()
        reply_to = message.reply_to or DEFAULT_REPLY_TO
        filename = job_headers.filename(headers)
        base = JobResult(job_id=job_id, status="done", filename=filename, worker=self.name)
        if (published := published_at(message)) is not None:
            base.timings["queued"] = max(0.0, time.time() - published)
        try:
            # first: every path below, a move or a requeue included, carries the job's own values on
            job = job_headers.read(headers)
        except BadRequest as exc:
            await self.outcomes.fail(message, base, exc, reply_to)
            return
        try:
            served = resolve(self.models, self.known, job, route)
            base.model = ModelInfo(name=served.model, version=served.version, random_weights=served.random_weights)
            if job.deliveries >= self.settings.queue_delivery_limit:
                raise DeliveryLimit(
                    f"delivered {job.deliveries + 1} times; every earlier worker died or hung while holding it "
                    "(a crashing codec or model input?)"
                )
            deadline = asyncio.get_running_loop().time() + self.settings.request_timeout
            # loaded within the deadline if the memory budget had unloaded it; a job is not admitted
            # as a request (the prefetch bounds what a worker holds)
            async with self.models.hold(served, deadline, admit=False):
                await _infer(served.classifier, ImageInput(message.body, filename), job.top_k, deadline, base)
            served.metrics.images_offline.inc()
            base.timings["processing"] = time.perf_counter() - started
            mark("done")
            await self.outcomes.result(base, reply_to, message)
            self.metrics.queue_events["acked"].inc()
        except POISON as exc:
            await self.outcomes.fail(message, base, exc, reply_to)
        except Misrouted as exc:
            logger.warning("worker: job %s is for model %s: moved to %s", job_id, exc.route.model, exc.route.queue)
            await self.outcomes.republish(message, job, exc.route, retries=job.retries, requeues=job.requeues)
            self.metrics.queue_events["rerouted"].inc()
        except NotServedHere as exc:
            if job.requeues >= NOT_SERVED_REQUEUES:
                await self.outcomes.fail(message, base, exc, reply_to)
            else:
                await self.outcomes.notify(message, not_served_notice(exc.what, job.requeues))
                await self._requeue_later(message, job, route, exc)
        except (BackendUnavailable, QueueFull, DeadlineExceeded) as exc:
            await self._requeue_later(message, job, route, exc)
        except GatewayError as exc:
            if job.retries < self.settings.max_retries:
                logger.warning("worker: job %s failed (%s), retry %d", job_id, exc.detail, job.retries + 1)
                mark("retried", exc)
                await self.outcomes.republish(message, job, route, retries=job.retries + 1, requeues=job.requeues)
                self.metrics.queue_events["retried"].inc()
            else:
                await self.outcomes.fail(message, base, exc, reply_to)

    async def stop(self, drain_timeout: float) -> None:
        """Stop consuming, then let the messages already taken finish (and be acked)."""
        self.closing = True
        for queue, tag in self._consumers.items():
            if self.broker.topology is None:
                break
            try:
                await self.broker.topology.work_queues[queue].cancel(tag)
            except Exception as exc:  # the broker may be gone; its redelivery covers us
                logger.warning("worker: could not cancel the consumer of %s: %s", queue, exc)
        if self._tasks:
            logger.info("worker: finishing %d messages", len(self._tasks))
            _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)  # ended before the connection closes
        await self._acks.aclose()


async def _infer(classifier: Classifier, image: ImageInput, top_k: int, deadline: float, result: JobResult) -> None:
    """Put what the job's model gives into its ``result``: labels, or an embedding."""
    if classifier.profile.output == "embedding":
        (vector,) = await classifier.embed([image], deadline=deadline)
        # each float32 in the fewest digits that give it back: 40 % less JSON than its double's repr
        result.embedding = [float(f"{value:.9g}") for value in vector.tolist()]
        return
    (classified,) = await classifier.classify([image], k=top_k, deadline=deadline)
    result.labels = [Label(index=i, label=lab, score=s) for i, lab, s in classified.labels]


async def run_worker(
    settings: Settings,
    stop: asyncio.Event | None = None,
    backend: Backend | None = None,
    metrics: Metrics | None = None,
    catalog: Catalog | None = None,
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop``), then stop consuming, finish and ack what was taken.
    ``metrics``: the registry to record in (a new one by default); ``catalog``: the models (by
    default the settings')."""
    if not settings.broker_url:
        raise SystemExit("gateway worker: GATEWAY_BROKER_URL is not set")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = metrics or Metrics()
    endpoint = serve_metrics(settings, metrics.registry)  # the first free port of its range, logged
    full = catalog if catalog is not None else load_catalog(settings)
    catalog = worker_catalog(full, settings.worker_models)
    # the messages it holds wait in its models' batchers: as many as the smallest holds (prefetch
    # counts per consumer: each of its models' queues holds that many at most; models found in
    # Triton's index later take the same). The default model's second queue holds only the jobs
    # queued before it became the default: while both have jobs, what a full batcher refuses is
    # requeued (QueueFull), never lost
    prefetch = min(version.settings.prefetch for model in catalog.models for version in model.versions)
    names = Names(settings.queue_prefix)
    tracing = Tracing.from_settings(settings, role="worker")
    async with open_models(settings, metrics, backend, tracing, catalog) as models:
        queues = assignment(names, full, models.models)  # with "*", the models found in Triton's index too
        broker = Broker(
            settings.broker_url,
            names,
            publish_timeout=settings.publish_timeout,
            prefetch=prefetch,
            routes=queues.declared,
        )
        await broker.connect()
        worker = Worker(settings, models, queues.consumed, broker, metrics, tracing, queues.known)
        await worker.start()
        webhooks = WebhookSender(settings, broker, metrics) if settings.webhook_secret is not None else None
        if webhooks is not None:
            await webhooks.start()
        else:
            logger.info("worker: no GATEWAY_WEBHOOK_SECRET; webhook deliveries wait for a worker that has it")
        broker_tasks = [  # they end by themselves once stop is set, each after its broker call
            asyncio.create_task(sample_depth(broker, metrics, stop, ingest=worker.ingest)),
            asyncio.create_task(migrate_legacy_queue(broker, stop)),
        ]
        beating = None
        if settings.worker_heartbeat_file is not None:
            beating = asyncio.create_task(heartbeat(settings.worker_heartbeat_file, HEARTBEAT_INTERVAL))
        print("worker ready", flush=True)
        await stop.wait()
        logger.info("worker: stopping")
        await worker.stop(drain_timeout=settings.request_timeout)
        if webhooks is not None:
            await webhooks.stop(drain_timeout=settings.webhook_timeout)
        if beating is not None:
            beating.cancel()
        # before the connection closes; bounded, for a broker that stopped answering
        _, stuck = await asyncio.wait(broker_tasks, timeout=BROKER_CALLS_TIMEOUT)
        for task in stuck:
            task.cancel()
    await broker.aclose()
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)
    logger.info("worker: stopped")
    if endpoint is not None:
        await asyncio.to_thread(endpoint.close)
