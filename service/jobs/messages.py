"""What travels through the broker.

A request is the encoded image itself as the body (validated cheaply before publishing, decoded by
the worker), with ``message_id`` = job id, ``content_type`` the image type, ``reply_to`` the results
routing key, and headers ``filename``, ``top_k``, ``x-retries`` and, when the submit gave one, the
completion webhook's URL (``x-webhook-url``, see ``service.jobs.webhooks``). A result is JSON. Both carry
the W3C trace headers (``traceparent``, ``tracestate``) of the span that sent them, when traced.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from pydantic import BaseModel, Field

from service.schemas import Label, ModelInfo

RETRIES_HEADER = "x-retries"
REQUEUES_HEADER = "x-requeues"
"""Times a job went back to the queue for overload (not counted as retries)."""
ERROR_HEADER = "x-gateway-error"
DETAIL_HEADER = "x-gateway-detail"
WEBHOOK_HEADER = "x-webhook-url"
DEFAULT_REPLY_TO = "jobs"
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
    error: JobError | None = None
    model: ModelInfo | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds: ``queued`` (publish to worker), ``processing`` (worker: decode, batch, infer)."""
    worker: str | None = None


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
) -> aio_pika.Message:
    headers: dict[str, Any] = {"top_k": top_k, RETRIES_HEADER: retries, **(trace or {})}
    if requeues:
        headers[REQUEUES_HEADER] = requeues
    if webhook is not None:
        headers[WEBHOOK_HEADER] = webhook
    if filename is not None:
        headers["filename"] = filename
    return aio_pika.Message(
        data,
        message_id=job_id,
        content_type=content_type,
        reply_to=reply_to,
        headers=headers,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        timestamp=time.time(),
    )


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


def dead_letter_message(message: AbstractIncomingMessage, error: str, detail: str) -> aio_pika.Message:
    """The copy of ``message`` for ``<prefix>.dead``: its headers (not the broker's ``x-death``,
    which grows with every round) with the reason in ``x-gateway-error`` and ``x-gateway-detail``."""
    headers = {k: v for k, v in (message.headers or {}).items() if k != "x-death"}
    headers[ERROR_HEADER] = error
    headers[DETAIL_HEADER] = detail[:1000]
    return copy_message(message, headers)


def result_message(result: JobResult, trace: Mapping[str, str] | None = None) -> aio_pika.Message:
    return aio_pika.Message(
        result.model_dump_json().encode(),
        message_id=result.job_id,
        content_type="application/json",
        headers=dict(trace) if trace else None,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
