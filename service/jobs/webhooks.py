"""Completion webhooks: when an offline job finishes, POST its result to the URL its submit gave.

* **Submit.** ``POST /classify?mode=offline`` with a ``Webhook-URL`` header (ASCII). The API checks
  the URL as it checks image URLs (``service.ssrf``: a well-formed URL, https only unless
  ``GATEWAY_WEBHOOK_ALLOW_HTTP``; the host's addresses public unless ``GATEWAY_WEBHOOK_ALLOWLIST``
  holds them) and every job's message carries it (``x-webhook-url``).
* **Finish.** The worker that finishes the job (``done`` or ``failed``) publishes the delivery, the
  JSON to POST, to the quorum queue ``<prefix>.webhooks`` before it acks the job. A worker killed
  in between redoes the job and publishes the delivery again, under the same webhook id.
* **Deliver.** Every ``gateway worker`` with ``GATEWAY_WEBHOOK_SECRET`` consumes that queue
  (``WebhookSender``, at most ``GATEWAY_WEBHOOK_CONCURRENCY`` at once) and POSTs, without following
  redirects, through the same guard, applied to the address actually connected to (a name that
  resolved to a public address at submit and to a private one now gains nothing). A 2xx answer
  acks the delivery. Anything else (another status, no answer within ``GATEWAY_WEBHOOK_TIMEOUT``,
  no connection) moves it to the retry queue of its next delay, then acks it.
* **Retry.** ``<prefix>.webhooks.retry.<ms>ms`` are quorum queues with that TTL that dead-letter,
  at least once, back to ``<prefix>.webhooks``: a delivery waiting for its next attempt is held by
  the broker, never in a worker's memory, so a worker or API restart loses nothing. The delays are
  ``GATEWAY_WEBHOOK_RETRY_DELAYS`` (default 1 s, 5 s, 30 s, 2 min, 10 min, 30 min, then 30 min
  again), each shortened by up to a fifth at random so that a burst of failures does not come back
  as one burst. A queue's arguments are a function of its name (its delay), so unlike the other
  queues' settings they need no policy: another schedule declares other queues.
* **Give up.** When the next attempt would start later than ``GATEWAY_WEBHOOK_MAX_AGE`` after the
  job finished, or at once when the receiver answers 410 Gone or the guard refuses the address,
  or at once (never POSTed) when its ``x-webhook-attempts`` is not a count (0-1,000,000) or its
  ``x-webhook-since`` not a time up to a minute ahead of the worker's clock (either would turn this
  rule off), the delivery is undeliverable: copied to ``<prefix>.dead`` with ``x-gateway-error:
  webhook_undeliverable`` and the last error in ``x-gateway-detail``, counted
  (``gateway_webhook_deliveries_total{outcome="undeliverable"}``) and logged.

**Signature** (Standard Webhooks, https://www.standardwebhooks.com): ``webhook-id`` is the job id,
the same on every attempt and on a duplicate, so a receiver that remembers ids sees each job once;
``webhook-timestamp`` is the attempt's Unix time; ``webhook-signature`` is ``v1,`` and the base64
HMAC-SHA256 of ``<id>.<timestamp>.<body>`` under the secret (``whsec_`` + base64, the form the
spec's libraries take). The body is ``{"type": "job.done" | "job.failed", "timestamp": <ISO 8601>,
"data": <the job's result: job_id, status, labels (an embedding model: embedding) or error, model, timings, worker>}``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import random
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aiohttp
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from service.errors import BadRequest, GatewayError
from service.jobs.broker import Broker
from service.jobs.headers import COUNT_MAX, integer
from service.jobs.messages import WEBHOOK_HEADER, JobResult, copy_message, dead_letter_message, trace_headers
from service.metrics import Metrics
from service.settings import Settings
from service.ssrf import guarded_session, parse_allowlist, parse_url, refused_reason

logger = logging.getLogger(__name__)


def signature(secret: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


ATTEMPT_HEADER = "x-webhook-attempts"
"""Attempts made before this one."""
SINCE_HEADER = "x-webhook-since"
"""When the job finished (Unix time in milliseconds, an integer: AMQP tables carry floats in
single precision, 2 minutes apart at today's times): the delivery gives up ``max_age`` after it."""
CLOCK_SKEW_MS = 60_000
"""How far ahead of this worker's clock ``x-webhook-since`` may be (another worker's clock)."""
JITTER = 0.2
USER_AGENT = "inference-gateway (webhook)"


def delivery_message(result: JobResult, url: str, trace: Mapping[str, str] | None = None) -> aio_pika.Message:
    """What the worker publishes to ``<prefix>.webhooks`` when a job with a webhook finishes."""
    now = time.time()
    payload = {
        "type": f"job.{result.status}",
        "timestamp": datetime.fromtimestamp(now, UTC).isoformat(),
        "data": result.model_dump(mode="json"),
    }
    return aio_pika.Message(
        json.dumps(payload, separators=(",", ":")).encode(),
        message_id=result.job_id,
        content_type="application/json",
        headers={WEBHOOK_HEADER: url, ATTEMPT_HEADER: 0, SINCE_HEADER: int(now * 1000), **(trace or {})},
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


class _Failed(Exception):
    """This attempt failed; another may succeed."""


class _Undeliverable(Exception):
    """No attempt can succeed (410 Gone, an address the guard refuses)."""


def _where(url: str) -> str:
    """The URL for logs: scheme, host and path, never the query (it may hold a token) nor
    credentials; of any text, a URL or not (a malformed one is logged as it is given up on)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # "https://[::1": split by hand, as the text before the query
        scheme, slashes, rest = url.partition("#")[0].partition("?")[0].partition("//")
        authority, slash, path = rest.partition("/")
        return f"{scheme}{slashes}{authority.rpartition('@')[2]}{slash}{path}"[:200]
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


class WebhookSender:
    """Consumes ``<prefix>.webhooks`` and delivers each message (see the module's docstring)."""

    def __init__(self, settings: Settings, broker: Broker, metrics: Metrics) -> None:
        if settings.webhook_key is None:
            raise ValueError("webhooks need GATEWAY_WEBHOOK_SECRET")
        self.secret = settings.webhook_key
        self.delays = settings.webhook_retry_delays_ms
        self.allow_http = settings.webhook_allow_http
        self.allowlist = parse_allowlist(settings.webhook_allowlist)
        self.timeout = settings.webhook_timeout
        self.max_age = settings.webhook_max_age
        self.concurrency = settings.webhook_concurrency
        self.broker = broker
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Declare the retry queues and consume, on a channel of its own (its prefetch is the
        number of deliveries in progress, not the worker's)."""
        assert self.broker.connection is not None
        names = self.broker.names
        self._channel = channel = await self.broker.connection.channel()
        await channel.set_qos(prefetch_count=self.concurrency)
        for delay in sorted(set(self.delays)):
            await channel.declare_queue(
                names.webhook_retry(delay),
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-message-ttl": delay,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": names.webhooks,
                    "x-dead-letter-strategy": "at-least-once",  # needs reject-publish: RabbitMQ's rule
                    "x-overflow": "reject-publish",
                },
            )
        self._queue = await channel.declare_queue(names.webhooks, durable=True, arguments={"x-queue-type": "quorum"})
        self._consumer_tag = await self._queue.consume(self._on_message)
        logger.info("webhooks: delivering from %s (%d at once)", names.webhooks, self.concurrency)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        """Ack once the outcome is settled (delivered, or the retry or dead letter confirmed by
        the broker); anything that escapes requeues the delivery."""
        try:
            async with message.process(requeue=True, ignore_processed=True):
                await self._attempt(message)
        except Exception:
            logger.exception("webhooks: delivery of %s could not be settled; requeued", message.message_id)

    async def _attempt(self, message: AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        url = str(headers.get(WEBHOOK_HEADER) or "")
        now_ms = int(time.time() * 1000)
        try:  # out of range, they would turn off the give-up rule: a delivery retried for ever
            attempts = integer(headers, ATTEMPT_HEADER, 0, 0, COUNT_MAX)
            since = integer(headers, SINCE_HEADER, now_ms, 0, now_ms + CLOCK_SKEW_MS) / 1000
        except BadRequest as exc:
            await self._give_up(message, exc.detail)
            return
        webhook_id = message.message_id or ""
        try:
            await self._post(url, webhook_id, message.body)
        except _Undeliverable as exc:
            await self._give_up(message, f"{exc} (attempt {attempts + 1})")
            return
        except _Failed as exc:
            delay = self.delays[min(attempts, len(self.delays) - 1)]
            age = time.time() - since
            if age + delay / 1000 > self.max_age:
                await self._give_up(message, f"{exc}; {attempts + 1} attempts in {age:.0f} s")
                return
            logger.info(
                "webhooks: job %s to %s failed (%s); attempt %d in %.1f s",
                webhook_id, _where(url), exc, attempts + 2, delay / 1000,
            )  # fmt: skip
            await self._retry(message, attempts + 1, delay)
            return
        self.metrics.webhook_deliveries.labels("delivered").inc()
        self.metrics.webhook_latency.observe(max(0.0, time.time() - since))

    async def _post(self, url: str, webhook_id: str, body: bytes) -> None:
        try:
            parsed = parse_url(url, "webhook URL", self.allow_http)
        except GatewayError as exc:
            raise _Undeliverable(exc.detail) from None
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(self.secret, webhook_id, timestamp, body),
        }
        try:
            async with self._client().post(parsed, data=body, headers=headers, allow_redirects=False) as response:
                status = response.status
        except TimeoutError:
            raise _Failed(f"no answer within {self.timeout:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            if (why := refused_reason(exc)) is not None:  # the address connected to, or its name's
                raise _Undeliverable(why) from None
            raise _Failed(f"cannot connect ({exc.os_error.strerror or exc})") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a request aiohttp cannot build
            raise _Failed(f"{type(exc).__name__}: {exc}") from None
        if 200 <= status < 300:
            return
        if status == 410:
            raise _Undeliverable("the receiver answered 410 Gone")
        raise _Failed(f"the receiver answered {status}")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = guarded_session(
                self.allowlist, timeout=self.timeout, limit=self.concurrency, headers={"User-Agent": USER_AGENT}
            )
        return self._session

    async def _retry(self, message: AbstractIncomingMessage, attempts: int, delay: int) -> None:
        source = message.headers or {}
        headers: dict[str, Any] = {
            WEBHOOK_HEADER: source.get(WEBHOOK_HEADER),
            ATTEMPT_HEADER: attempts,
            SINCE_HEADER: source.get(SINCE_HEADER, int(time.time() * 1000)),
            **trace_headers(source),
        }  # not the broker's x-death: it would grow with every round
        wait = delay * random.uniform(1 - JITTER, 1.0) / 1000
        queue = self.broker.names.webhook_retry(delay)
        await self.broker.publish("queue", copy_message(message, headers, expiration=wait), queue)
        self.metrics.webhook_deliveries.labels("retried").inc()

    async def _give_up(self, message: AbstractIncomingMessage, why: str) -> None:
        await self.broker.publish("dead", dead_letter_message(message, "webhook_undeliverable", why), "")
        self.metrics.webhook_deliveries.labels("undeliverable").inc()
        url = str((message.headers or {}).get(WEBHOOK_HEADER) or "")
        logger.warning("webhooks: job %s to %s undeliverable: %s", message.message_id, _where(url), why)

    async def stop(self, drain_timeout: float) -> None:
        """Stop consuming, let the deliveries in progress settle, close the client."""
        if self._consumer_tag is not None and self._queue is not None:
            try:
                await self._queue.cancel(self._consumer_tag)
            except Exception as exc:  # the broker may be gone; its redelivery covers us
                logger.warning("webhooks: could not cancel the consumer: %s", exc)
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=drain_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)  # ended before the connection closes
        if self._session is not None:
            await self._session.close()
        if self._channel is not None and not self._channel.is_closed:
            await self._channel.close()
