"""What travels through the broker.

A request is the encoded image itself as the body (validated cheaply before publishing, decoded by
the worker), with ``message_id`` = job id, ``content_type`` the image type, ``reply_to`` the results
routing key, and headers ``filename``, ``top_k``, ``x-retries``, ``x-published-ms`` (the publish time
in Unix milliseconds: the AMQP ``timestamp`` has whole seconds), the model it is for (``x-model``;
absent on jobs of earlier versions: the default model), the version when the submit named one
(``x-model-version``; absent: the worker picks one by the model's traffic weights) and, when the
submit gave one, the completion webhook's URL (``x-webhook-url``, see ``service.jobs.webhooks``).
A result is JSON: ``labels`` from a model that gives labels, ``embedding`` (the vector, float32
values) from one that gives embeddings. Both carry the W3C trace headers (``traceparent``, ``tracestate``) of the span
that sent them, when traced.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from pamqp.encode import encode_table_value
from pydantic import BaseModel, Field

from service.schemas import Label, ModelInfo

RETRIES_HEADER = "x-retries"
REQUEUES_HEADER = "x-requeues"
"""Times a job went back to the queue for overload (not counted as retries)."""
ERROR_HEADER = "x-gateway-error"
DETAIL_HEADER = "x-gateway-detail"
WEBHOOK_HEADER = "x-webhook-url"
MODEL_HEADER = "x-model"
VERSION_HEADER = "x-model-version"
PUBLISHED_HEADER = "x-published-ms"
"""Unix time in milliseconds at which the request was published (``timings.queued``)."""
DROPPED_HEADER = "x-gateway-dropped-headers"
"""On a dead-letter copy: the headers of the original left out for size (``HEADERS_BUDGET``)."""
HEADERS_BUDGET = 64 * 1024
WEBHOOK_URL_MAX = 8192
"""The longest ``x-webhook-url`` a worker takes (the header is copied into the delivery message)."""
UNDECODABLE_HEADER = "x-gateway-undecodable"
"""Set on receipt when a message's properties could not be decoded (``service.jobs.frames``)."""
DEFAULT_REPLY_TO = "jobs"
WAITING_TYPE = "job.waiting"
"""The AMQP ``type`` of a notice that a job is still waiting, and why (``JobNotice``)."""
NOTICE_TTL_MS = 60_000
"""A notice not taken within this long is dropped: a later one, or the result, says more."""
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """The trace context a message carries, to pass on unchanged (a retry stays in its trace)."""
    return {name: str(headers[name]) for name in TRACE_HEADERS if headers.get(name) is not None}


class JobError(BaseModel):
    error: str
    detail: str


class JobResult(BaseModel):
    job_id: str
    status: Literal["done", "failed"]
    filename: str | None = None
    labels: list[Label] = Field(default_factory=list)
    embedding: list[float] | None = None
    """Done by a model that gives embeddings: its vector (float32 values); None otherwise."""
    error: JobError | None = None
    model: ModelInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds: ``queued`` (publish to worker), ``processing`` (worker: decode, batch, infer)."""
    worker: str | None = None


class JobNotice(BaseModel):
    """What a worker tells the API about a job it could not run yet, on ``<prefix>.notices``
    (``GET /jobs/{id}``'s ``waiting``)."""

    job_id: str
    waiting: str


def notice_message(notice: JobNotice) -> aio_pika.Message:
    """A notice: transient and short-lived (best effort: the job's result is what counts)."""
    return aio_pika.Message(
        notice.model_dump_json().encode(),
        message_id=notice.job_id,
        content_type="application/json",
        type=WAITING_TYPE,
        expiration=NOTICE_TTL_MS / 1000,
    )


def new_job_id() -> str:
    return uuid.uuid4().hex


def request_message(
    data: bytes,
    *,
    job_id: str,
    content_type: str,
    filename: str | None,
    top_k: int,
    reply_to: str,
    retries: int = 0,
    requeues: int = 0,
    trace: Mapping[str, str] | None = None,
    webhook: str | None = None,
    model: str | None = None,
    version: str | None = None,
) -> aio_pika.Message:
    now = time.time()
    headers: dict[str, Any] = {
        "top_k": top_k,
        RETRIES_HEADER: retries,
        PUBLISHED_HEADER: round(now * 1000),
        **(trace or {}),
    }
    if requeues:
        headers[REQUEUES_HEADER] = requeues
    if webhook is not None:
        headers[WEBHOOK_HEADER] = webhook
    if model is not None:
        headers[MODEL_HEADER] = model
    if version is not None:
        headers[VERSION_HEADER] = version
    if filename is not None:
        headers["filename"] = filename
    return aio_pika.Message(
        data,
        message_id=job_id,
        content_type=content_type,
        reply_to=reply_to,
        headers=headers,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=now,
    )


def published_at(message: AbstractIncomingMessage) -> float | None:
    """Unix time (seconds) at which ``message`` was published: the AMQP timestamp (whole seconds)
    refined by the ``x-published-ms`` header. The header is used only where it agrees with the
    timestamp (within the same second), or, without a timestamp, where it is a positive number: a
    header of another type, or one that says something else, cannot skew ``timings.queued``.
    None: neither is given (a producer other than the gateway)."""
    stamp = message.timestamp.timestamp() if message.timestamp is not None else None
    value = (message.headers or {}).get(PUBLISHED_HEADER)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        seconds = value / 1000
        if (stamp is None and seconds > 0) or (stamp is not None and 0 <= seconds - stamp <= 1):
            return seconds
    return stamp


def copy_message(message: AbstractIncomingMessage, headers: Mapping[str, Any], **properties: Any) -> aio_pika.Message:
    """A persistent copy of a received message (body, id, content type, reply-to) with ``headers``
    and any other ``properties``, to publish elsewhere."""
    return aio_pika.Message(
        message.body,
        message_id=message.message_id,
        content_type=message.content_type,
        reply_to=message.reply_to,
        headers=dict(headers),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        **properties,
    )


def _encodes(value: Any) -> bool:
    """Whether pamqp can encode ``value`` as a header again. It decodes values it cannot encode:
    a double beyond float32's range (it encodes every float as one), a long string that is not
    UTF-8 (decoded as bytes, which it refuses)."""
    try:
        encode_table_value(value)
    except Exception:
        return False
    return True


def _within_budget(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` without those pamqp cannot encode again, and with the largest left out until the
    rest takes about ``HEADERS_BUDGET`` bytes (their names then in ``x-gateway-dropped-headers``).
    A message's properties must fit in one frame (128 KiB by default): a received message near that
    size, copied with two more headers, was a frame RabbitMQ refused by closing the whole
    connection; a copy with a header that cannot be encoded could not be published at all (the
    message was redelivered at once, for ever, with a failed result each time)."""
    dropped = [name for name, value in headers.items() if not _encodes(value)]
    sizes = {name: len(name) + len(repr(value)) for name, value in headers.items() if name not in dropped}
    for name in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if sum(sizes.values()) <= HEADERS_BUDGET:
            break
        dropped.append(name)
        del sizes[name]
    if not dropped:
        return headers
    kept = {name: headers[name] for name in sizes}
    kept[DROPPED_HEADER] = ",".join(dropped)[:1000]
    return kept


def dead_letter_message(
    message: AbstractIncomingMessage, error: str, detail: str, job_id: str | None = None
) -> aio_pika.Message:
    """The copy of ``message`` for ``<prefix>.dead``: its headers (not the broker's ``x-death``,
    which grows with every round) with the reason in ``x-gateway-error`` and ``x-gateway-detail``,
    and ``job_id`` as its id when it came without one (the id its failed result was given)."""
    headers = _within_budget({k: v for k, v in (message.headers or {}).items() if k != "x-death"})
    headers[ERROR_HEADER] = error
    headers[DETAIL_HEADER] = detail[:1000]
    copy = copy_message(message, headers)
    copy.message_id = message.message_id or job_id
    return copy


def result_message(result: JobResult, trace: Mapping[str, str] | None = None) -> aio_pika.Message:
    return aio_pika.Message(
        result.model_dump_json().encode(),
        message_id=result.job_id,
        content_type="application/json",
        headers=dict(trace) if trace else None,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
