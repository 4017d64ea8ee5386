"""How a job's outcome reaches the broker: its result (and webhook delivery), its dead-letter copy,
or a copy of the job put back in a queue; each publish confirmed, and tried again while the
input's channel lives when the broker does not take it (see ``service.jobs.worker``'s docstring)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Literal

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from service.errors import BackendUnavailable, GatewayError
from service.jobs.broker import Broker
from service.jobs.headers import JobHeaders, filename, webhook_url
from service.jobs.messages import (
    DEFAULT_REPLY_TO,
    JobError,
    JobNotice,
    JobResult,
    dead_letter_message,
    new_job_id,
    notice_message,
    request_message,
    result_message,
    trace_headers,
)
from service.jobs.topology import Route
from service.jobs.webhooks import delivery_message
from service.metrics import Metrics
from service.tracing import current_headers

logger = logging.getLogger(__name__)

PUBLISH_PAUSE = 0.5
"""Seconds before the first new try of a publish the broker did not take; doubled at each try."""
PUBLISH_PAUSE_MAX = 30.0


class ChannelLost(Exception):
    """The input's channel closed before its outcome was published: the broker redelivers it."""


def channel_closed(message: AbstractIncomingMessage) -> bool:
    """Whether ``message``'s channel is gone (aio-pika's ``message.channel`` raises then, rather
    than return a closed channel)."""
    try:
        return message.channel.is_closed
    except aiormq.exceptions.ChannelInvalidStateError:
        return True


def mark(outcome: str, error: GatewayError | None = None) -> None:
    """Say on the job's span (when traced) how its message ended."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("gateway.job.outcome", outcome)
        if error is not None:
            span.set_attribute("gateway.error", error.error)
            if outcome == "failed":
                span.set_status(StatusCode.ERROR, error.detail)


class Outcomes:
    """Publishes the outcomes of a worker's jobs through its broker, counting them in its metrics."""

    def __init__(self, broker: Broker, metrics: Metrics) -> None:
        self.broker = broker
        self.metrics = metrics

    async def publish(
        self,
        target: Literal["requests", "results", "dead", "queue"],
        message: aio_pika.Message,
        key: str,
        source: AbstractIncomingMessage,
    ) -> None:
        """Publish part of ``source``'s outcome, confirmed. What the broker does not take (nacked,
        returned, not confirmed in time, no connection) is tried again after a backoff while
        ``source``'s channel lives; ``ChannelLost`` once it is gone."""
        tries = 0
        while True:
            try:
                await self.broker.publish(target, message, key)
            except BackendUnavailable as exc:
                if channel_closed(source):
                    raise ChannelLost(exc.detail) from exc
                pause = min(PUBLISH_PAUSE * 2**tries, PUBLISH_PAUSE_MAX) * random.uniform(0.5, 1.0)
                tries += 1
                self.metrics.queue_events["publish_retried"].inc()
                logger.warning(
                    "worker: job %s: publish to %s not taken (%s); try %d in %.1f s",
                    source.message_id,
                    target,
                    exc.detail,
                    tries + 1,
                    pause,
                )
                await asyncio.sleep(pause)
            else:
                if tries:
                    logger.info("worker: job %s: published to %s at try %d", source.message_id, target, tries + 1)
                return

    async def result(self, result: JobResult, reply_to: str, message: AbstractIncomingMessage) -> None:
        """Publish the result and, when the submit gave a webhook, its delivery (both confirmed
        before the job is acked: a worker killed in between does the job again)."""
        trace_context = current_headers()
        await self.publish("results", result_message(result, trace_context), reply_to, message)
        self.metrics.queue_events["results_published"].inc()
        webhook = webhook_url(message.headers or {})
        if webhook is not None:
            delivery = delivery_message(result, webhook, trace_context)
            await self.publish("queue", delivery, self.broker.names.webhooks, message)
            self.metrics.queue_events["webhooks_published"].inc()

    async def fail(self, message: AbstractIncomingMessage, base: JobResult, error: GatewayError, reply: str) -> None:
        """Publish a ``failed`` result, then the input's dead-letter copy with the reason."""
        logger.warning("worker: job %s dead-lettered: %s: %s", base.job_id, error.error, error.detail)
        failed = base.model_copy(update={"status": "failed", "error": JobError(error=error.error, detail=error.detail)})
        mark("failed", error)
        await self.result(failed, reply, message)
        dead = dead_letter_message(message, error.error, error.detail, base.job_id)
        await self.publish("dead", dead, "", message)
        self.metrics.queue_events["dead_lettered"].inc()
        self.metrics.queue_events["acked"].inc()

    async def notify(self, message: AbstractIncomingMessage, waiting: str) -> None:
        """Tell the API replicas why the job is still waiting (``GET /jobs/{id}``'s ``waiting``):
        best effort, once, within the publish timeout (the job's outcome does not depend on it).
        Only for a job whose results go to the API: nothing takes the notice of another (an
        ingest run's). Published like any outcome, on the publisher channel, never the consumers'
        channel: a publish the broker fails with a channel error (the exchange gone) closed that
        channel, and every job the worker held went back to its queue."""
        if not message.message_id or (message.reply_to or DEFAULT_REPLY_TO) != DEFAULT_REPLY_TO:
            return
        notice = notice_message(JobNotice(job_id=message.message_id, waiting=waiting))
        try:
            await self.broker.publish("notices", notice, DEFAULT_REPLY_TO)
        except BackendUnavailable as exc:  # a notice lost costs nothing but the explanation
            logger.info("worker: job %s: notice not published (%s)", message.message_id, exc.detail)

    async def republish(
        self, message: AbstractIncomingMessage, job: JobHeaders, route: Route, *, retries: int, requeues: int
    ) -> None:
        """Put a copy of the job, with what its headers ask for, at the tail of ``route``'s queue
        (the input is then acked)."""
        headers = message.headers or {}
        again = request_message(
            message.body,
            job_id=message.message_id or new_job_id(),
            content_type=message.content_type or "application/octet-stream",
            filename=filename(headers),
            top_k=job.top_k,
            reply_to=message.reply_to or DEFAULT_REPLY_TO,
            retries=retries,
            requeues=requeues,
            trace=trace_headers(headers),  # a retry stays in its job's trace
            webhook=job.webhook,
            model=job.model,
            version=job.version,
        )
        await self.publish("requests", again, route.key, message)
