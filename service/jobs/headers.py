"""A job message's headers, read and checked once, before the worker does anything with the job.

What a job asks for (``top_k``, its model and version, its webhook) and what the gateway counts on
it (``x-retries``, ``x-requeues``, the broker's ``x-delivery-count``) are read together, so that
every path, a job moved to its model's queue or requeued included, carries the job's own values on
to its copy (``top_k`` used to be read only once the job's model was found served here: a moved or
requeued copy said 5).

A header of the wrong type, or a number out of its range, makes the job a bad request: it fails
once with the header named, its dead-letter copy says why, and it is never redelivered in a loop.
Not clamped: the counters are written by gateway processes only, so a value out of range comes from
a producer that is not the gateway, or a broken one, and is a wrong job, not a wrong count.
Clamping would hide that and give the job a meaning its producer never wrote. Above all, no value
may turn a cap off: a negative ``x-requeues`` used to remove both the requeue cap of a job no worker
serves and its backoff (it went round thousands of times a second), a negative ``x-retries`` the
retry cap. The ranges:

* ``top_k``: 1-20, as the API takes it;
* ``x-retries``, ``x-requeues``, ``x-delivery-count``: 0 to ``COUNT_MAX``. A count at or above its
  cap means the cap is reached (``x-retries`` 3: no retry left), which is what it says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import BadRequest
from service.jobs.messages import (
    MODEL_HEADER,
    REQUEUES_HEADER,
    RETRIES_HEADER,
    UNDECODABLE_HEADER,
    VERSION_HEADER,
    WEBHOOK_HEADER,
    WEBHOOK_URL_MAX,
)
from service.serving.catalog import VERSION
from service.settings.values import MODEL_NAME

DELIVERY_COUNT_HEADER = "x-delivery-count"
"""Set by quorum queues: how many times the message was delivered before."""
TOP_K_HEADER = "top_k"
TOP_K_MAX = 20
COUNT_MAX = 1_000_000
"""The largest count a job's header may carry: a job requeued that often at the longest pause
(30 s) has waited about a year. Below what AMQP's integers hold, so a copy's count + 1 encodes."""


@dataclass(frozen=True)
class JobHeaders:
    """A job's headers, checked: what the worker acts on, and carries over to a copy of the job."""

    top_k: int
    retries: int
    """Backend failures the job met before (``x-retries``)."""
    requeues: int
    """Times it went back to its queue for overload, or for want of a worker serving it (``x-requeues``)."""
    deliveries: int
    """Times the broker delivered it before (``x-delivery-count``)."""
    model: str | None
    """The model it names (None: the model of the queue it came from)."""
    version: str | None
    """The version it names (None: picked by the model's traffic weights)."""
    webhook: str | None


def integer(headers: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    """An integer header within [low, high] (absent: ``default``); else the job is a bad request."""
    value = headers.get(name, default)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = int(str(value))
    except (TypeError, ValueError):
        raise BadRequest(f"bad message header: {name}={repr(value)[:100]} is not an integer") from None
    if not low <= number <= high:
        raise BadRequest(f"bad message header: {name}={repr(value)[:100]} is not within {low}-{high}")
    return number


def _name(headers: Mapping[str, Any], name: str, form: re.Pattern[str], what: str) -> str | None:
    """A model or version header: a name of ``form``, or absent (None); else the job is a bad request."""
    value = headers.get(name)
    if value is None or (isinstance(value, str) and form.fullmatch(value)):
        return value
    raise BadRequest(f"bad message header: {name}={repr(value)[:100]} is not {what}")


def webhook_url(headers: Mapping[str, Any]) -> str | None:
    """The job's webhook URL, read leniently (a failed job's result is delivered to it too); None
    also when it is too long to carry (``read`` fails such a job)."""
    url = str(headers[WEBHOOK_HEADER]) if headers.get(WEBHOOK_HEADER) else None
    return url if url is not None and len(url) <= WEBHOOK_URL_MAX else None


def filename(headers: Mapping[str, Any]) -> str | None:
    return str(headers["filename"]) if headers.get("filename") is not None else None


def delivered_before(headers: Mapping[str, Any]) -> bool:
    """Whether the broker says the job was delivered before (read leniently: a worker may have died
    holding it, so it is handled alone; ``read`` then checks the header)."""
    return str(headers.get(DELIVERY_COUNT_HEADER, 0)) != "0"


def read(headers: Mapping[str, Any]) -> JobHeaders:
    """The job's headers, checked (see the module's docstring); ``BadRequest`` naming the first
    header that is wrong."""
    if UNDECODABLE_HEADER in headers:
        raise BadRequest(f"the message's properties could not be decoded ({headers[UNDECODABLE_HEADER]!s})")
    if headers.get(WEBHOOK_HEADER) and webhook_url(headers) is None:
        raise BadRequest(f"{WEBHOOK_HEADER} is longer than {WEBHOOK_URL_MAX} characters")
    return JobHeaders(
        top_k=integer(headers, TOP_K_HEADER, 5, 1, TOP_K_MAX),
        retries=integer(headers, RETRIES_HEADER, 0, 0, COUNT_MAX),
        requeues=integer(headers, REQUEUES_HEADER, 0, 0, COUNT_MAX),
        deliveries=integer(headers, DELIVERY_COUNT_HEADER, 0, 0, COUNT_MAX),
        model=_name(headers, MODEL_HEADER, MODEL_NAME, "a model name"),
        version=_name(headers, VERSION_HEADER, VERSION, "a version (1-999999999)"),
        webhook=webhook_url(headers),
    )
