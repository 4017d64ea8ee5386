"""``gateway worker``: consume images from RabbitMQ, classify them in batches, publish results.

Delivery is at least once: an input is acknowledged only after its result is confirmed by the
broker, so a worker killed at any point loses nothing (its unacknowledged messages go back to the
queue). Outcomes per message:

* classified -> result ``done`` published, input acked;
* bad input (undecodable, too large, not an image, bad headers) -> result ``failed`` published, the
  message copied to the dead-letter exchange with the reason in ``x-gateway-error`` /
  ``x-gateway-detail``, input acked: dead-lettered once, never redelivered in a loop;
* backend failure -> republished with ``x-retries`` + 1 (then acked) up to ``max_retries``, then
  dead-lettered like bad input;
* backend unavailable (down, not ready) -> requeued after a pause, not counted as a retry;
* broker lost while publishing or acking -> nothing more; the broker redelivers the input.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from typing import Literal

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import start_http_server

from service.backends.base import Backend
from service.classifier import Classifier, ImageInput
from service.errors import (
    BackendUnavailable,
    BadImage,
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from service.jobs.broker import Broker
from service.jobs.messages import (
    DEFAULT_REPLY_TO,
    DETAIL_HEADER,
    ERROR_HEADER,
    RETRIES_HEADER,
    JobError,
    JobResult,
    new_job_id,
    request_message,
    result_message,
)
from service.jobs.topology import REQUEST_KEY, Names
from service.metrics import Metrics
from service.pipeline import open_pipeline
from service.schemas import Label, ModelInfo
from service.settings import Settings

logger = logging.getLogger(__name__)

POISON = (BadImage, BadRequest, PayloadTooLarge, UnsupportedMediaType)
UNAVAILABLE_PAUSE = 1.0


class _BrokerLost(Exception):
    """Publishing failed because the broker went away; the input will be redelivered."""


class Worker:
    def __init__(self, settings: Settings, classifier: Classifier, broker: Broker, metrics: Metrics) -> None:
        self.settings = settings
        self.classifier = classifier
        self.broker = broker
        self.metrics = metrics
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._consumer_tag: str | None = None
        self.closing = False

    async def start(self) -> None:
        assert self.broker.topology is not None
        self._consumer_tag = await self.broker.topology.requests_queue.consume(self._on_message)
        logger.info(
            "worker %s: consuming %s (prefetch %d)", self.name, self.broker.names.requests, self.broker.prefetch
        )

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        self.metrics.queue_messages.labels("consumed").inc()
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(
        self, target: Literal["requests", "results", "dead"], message: aio_pika.Message, key: str
    ) -> None:
        try:
            await self.broker.publish(target, message, key)
        except BackendUnavailable as exc:
            raise _BrokerLost(str(exc)) from exc

    async def _publish_result(self, result: JobResult, reply_to: str) -> None:
        await self._publish("results", result_message(result), reply_to)
        self.metrics.queue_messages.labels("results_published").inc()

    async def _dead_letter(self, message: AbstractIncomingMessage, error: GatewayError) -> None:
        headers = dict(message.headers or {})
        headers[ERROR_HEADER] = error.error
        headers[DETAIL_HEADER] = error.detail[:1000]
        copy = aio_pika.Message(
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            reply_to=message.reply_to,
            headers=headers,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._publish("dead", copy, "")
        self.metrics.queue_messages.labels("dead_lettered").inc()

    async def _fail(self, message: AbstractIncomingMessage, base: JobResult, error: GatewayError, reply: str) -> None:
        logger.warning("worker: job %s dead-lettered: %s: %s", base.job_id, error.error, error.detail)
        failed = base.model_copy(update={"status": "failed", "error": JobError(error=error.error, detail=error.detail)})
        await self._publish_result(failed, reply)
        await self._dead_letter(message, error)
        await message.ack()
        self.metrics.queue_messages.labels("acked").inc()

    async def _retry(self, message: AbstractIncomingMessage, retries: int, top_k: int, filename: str | None) -> None:
        again = request_message(
            message.body,
            job_id=message.message_id or new_job_id(),
            content_type=message.content_type or "application/octet-stream",
            filename=filename,
            top_k=top_k,
            reply_to=message.reply_to or DEFAULT_REPLY_TO,
            retries=retries + 1,
        )
        await self._publish("requests", again, REQUEST_KEY)
        await message.ack()
        self.metrics.queue_messages.labels("retried").inc()

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        started = time.perf_counter()
        headers = message.headers or {}
        job_id = message.message_id or new_job_id()
        reply_to = message.reply_to or DEFAULT_REPLY_TO
        filename = str(headers["filename"]) if headers.get("filename") is not None else None
        profile = self.classifier.profile
        base = JobResult(
            job_id=job_id,
            status="done",
            filename=filename,
            model=ModelInfo(name=profile.name, version=profile.version),
            worker=self.name,
        )
        if message.timestamp is not None:
            base.timings["queued"] = max(0.0, time.time() - message.timestamp.timestamp())
        top_k, retries = 5, 0
        try:
            try:
                top_k = int(str(headers.get("top_k", 5)))
                retries = int(str(headers.get(RETRIES_HEADER, 0)))
            except (TypeError, ValueError):
                raise BadRequest(f"bad message headers: top_k={headers.get('top_k')!r}") from None
            if not 1 <= top_k <= 20:
                raise BadRequest(f"top_k must be 1-20, not {top_k}")
            (classified,) = await self.classifier.classify([ImageInput(message.body, filename)], k=top_k, deadline=None)
            base.labels = [Label(index=i, label=lab, score=s) for i, lab, s in classified.labels]
            self.metrics.images.labels("offline").inc()
            base.timings["processing"] = time.perf_counter() - started
            await self._publish_result(base, reply_to)
            await message.ack()
            self.metrics.queue_messages.labels("acked").inc()
        except POISON as exc:
            await self._fail(message, base, exc, reply_to)
        except BackendUnavailable as exc:
            logger.warning("worker: backend unavailable (%s); requeueing job %s", exc.detail, job_id)
            if not self.closing:
                await asyncio.sleep(UNAVAILABLE_PAUSE)
            await message.nack(requeue=True)
            self.metrics.queue_messages.labels("requeued").inc()
        except GatewayError as exc:
            if retries < self.settings.max_retries:
                logger.warning("worker: job %s failed (%s), retry %d", job_id, exc.detail, retries + 1)
                await self._retry(message, retries, top_k, filename)
            else:
                await self._fail(message, base, exc, reply_to)
        except _BrokerLost as exc:
            logger.warning("worker: broker lost while finishing job %s (%s); it will be redelivered", job_id, exc)
        except Exception:
            logger.exception("worker: job %s could not be finished; the broker will redeliver it", job_id)

    async def stop(self, drain_timeout: float) -> None:
        """Stop consuming, then let the messages already taken finish (and be acked)."""
        self.closing = True
        if self._consumer_tag is not None and self.broker.topology is not None:
            try:
                await self.broker.topology.requests_queue.cancel(self._consumer_tag)
            except Exception as exc:  # the broker may be gone; its redelivery covers us
                logger.warning("worker: could not cancel the consumer: %s", exc)
        if self._tasks:
            logger.info("worker: finishing %d messages", len(self._tasks))
            _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout)
            for task in pending:
                task.cancel()


async def _sample_depth(broker: Broker, metrics: Metrics, interval: float = 5.0) -> None:
    while True:
        if broker.is_open and broker.channel is not None:
            for name in (broker.names.requests, broker.names.dead):
                try:
                    queue = await broker.channel.declare_queue(name, passive=True)
                    count = queue.declaration_result.message_count or 0
                    metrics.queue_depth_messages.labels(name).set(count)
                except Exception as exc:
                    logger.debug("worker: cannot sample %s: %s", name, exc)
        await asyncio.sleep(interval)


async def run_worker(settings: Settings, stop: asyncio.Event | None = None, backend: Backend | None = None) -> None:
    """Run until SIGTERM/SIGINT (or ``stop``), then stop consuming, finish and ack what was taken."""
    if not settings.broker_url:
        raise SystemExit("gateway worker: GATEWAY_BROKER_URL is not set")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    if settings.worker_metrics_port:
        start_http_server(settings.worker_metrics_port, addr=settings.host, registry=metrics.registry)
    broker = Broker(
        settings.broker_url,
        Names(settings.queue_prefix),
        publish_timeout=settings.publish_timeout,
        prefetch=settings.prefetch,
    )
    async with open_pipeline(settings, metrics, backend) as pipeline:
        await broker.connect()
        worker = Worker(settings, pipeline.classifier, broker, metrics)
        await worker.start()
        sampler = asyncio.create_task(_sample_depth(broker, metrics))
        print("worker ready", flush=True)
        await stop.wait()
        logger.info("worker: stopping")
        await worker.stop(drain_timeout=settings.request_timeout)
        sampler.cancel()
    await broker.aclose()
    logger.info("worker: stopped")
