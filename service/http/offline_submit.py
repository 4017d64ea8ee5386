"""``mode=offline`` on the image routes: every image validated cheaply (type, header, dimensions),
then queued as a job to its model's queue, answered 202 with a job id per image; with an
``Idempotency-Key`` a retry queues nothing new, and with a ``Webhook-URL`` each job's result is
also POSTed there. What a job answers (labels or an embedding) is its model's output kind: the
worker reads it (``service.jobs.worker``)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from service.classifier import ImageInput, validate
from service.errors import BadRequest
from service.http.gateway import Gateway
from service.http.middleware import API_KEY
from service.jobs.client import JobTarget, OfflineImage
from service.schemas import AcceptedJob, JobsAccepted
from service.serving.served import ServedVersion
from service.settings import Settings
from service.ssrf import check_destination, parse_allowlist

IDEMPOTENCY_KEY = "Idempotency-Key"
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
WEBHOOK_URL = "Webhook-URL"
MAX_WEBHOOK_URL = 2048
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")

HEADERS_DOC: list[dict[str, Any]] = [
    {
        "name": IDEMPOTENCY_KEY,
        "in": "header",
        "required": False,
        "description": "mode=offline: a retry with the same key and the same body gets the same job ids "
        "(202, with `Idempotent-Replayed: true` when nothing new was queued) and queues nothing new, also on "
        "another replica at the same moment; the same key with another body is 409. Remembered for "
        "GATEWAY_IDEMPOTENCY_TTL seconds, per API key. Ignored online (an online answer is computed again).",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    },
    {
        "name": WEBHOOK_URL,
        "in": "header",
        "required": False,
        "description": "mode=offline only: when each job finishes (done or failed), its result is POSTed to this "
        'URL as JSON, `{"type": "job.done"|"job.failed", "timestamp": ..., "data": <the job\'s result>}`, signed '
        "the Standard Webhooks way (`webhook-id`: the job id, `webhook-timestamp`, `webhook-signature`: "
        "`v1,` + base64 HMAC-SHA256 of `id.timestamp.body` under GATEWAY_WEBHOOK_SECRET). A 2xx answer "
        "accepts it; anything else is retried with growing delays (GATEWAY_WEBHOOK_RETRY_DELAYS) for up to "
        "GATEWAY_WEBHOOK_MAX_AGE seconds. At least once: a receiver that remembers `webhook-id` sees each "
        "job once. https only unless GATEWAY_WEBHOOK_ALLOW_HTTP; the host must resolve to public addresses "
        "unless GATEWAY_WEBHOOK_ALLOWLIST holds them (403 `url_not_allowed`). 400 when webhooks are off "
        "(no GATEWAY_WEBHOOK_SECRET), online, or the host cannot be resolved.",
        "schema": {"type": "string", "format": "uri", "maxLength": MAX_WEBHOOK_URL},
    },
]
ACCEPTED_DOC: dict[str, Any] = {
    "model": JobsAccepted,
    "description": "mode=offline: one job per image.",
    "headers": {
        IDEMPOTENT_REPLAYED: {
            "description": "`true` when an earlier submit with this Idempotency-Key had queued every "
            "image: the same job ids, nothing queued again.",
            "schema": {"type": "string", "enum": ["true"]},
        }
    },
}
"""The 202 answer, for the routes' OpenAPI ``responses``."""


async def submit(
    request: Request,
    gateway: Gateway,
    served: ServedVersion,
    images: list[ImageInput],
    top_k: int,
    version: str | None,
) -> JSONResponse:
    """Validate every image cheaply, then publish each as a job to its model's queue, naming the
    version if the request did (``version``; else the workers pick one by weight)."""
    if gateway.jobs is None:  # a property of this deployment, not a passing fault: retrying cannot help
        raise BadRequest("mode=offline is not available: this gateway has no message broker (GATEWAY_BROKER_URL)")
    key = _idempotency_key(request)
    webhook = await _webhook_url(request, gateway.settings)
    await validate(images, served.config, served.executor)  # the queue workers infer: nothing is loaded here
    offline = [OfflineImage(i.data, i.content_type or "application/octet-stream", i.filename) for i in images]
    owner = request.scope.get(API_KEY) or ""
    target = JobTarget(gateway.jobs.names.route(served.model, gateway.models.default.name), version)
    submitted = await gateway.jobs.submit(offline, top_k, owner=owner, key=key, webhook=webhook, target=target)
    body = JobsAccepted(
        jobs=[
            AcceptedJob(job_id=job_id, filename=image.filename, status_url=f"/jobs/{job_id}")
            for job_id, image in zip(submitted.job_ids, images, strict=True)
        ]
    )
    headers = {IDEMPOTENT_REPLAYED: "true"} if submitted.replayed else None
    return JSONResponse(body.model_dump(), status_code=202, headers=headers)


def refuse_webhook_online(request: Request) -> None:
    if WEBHOOK_URL in request.headers:
        raise BadRequest(f"{WEBHOOK_URL} is for mode=offline: an online answer is the result itself")


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_KEY)
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.fullmatch(key):
        raise BadRequest(f"{IDEMPOTENCY_KEY} must be 1-255 printable ASCII characters")
    return key


async def _webhook_url(request: Request, settings: Settings) -> str | None:
    url = request.headers.get(WEBHOOK_URL)
    if url is None:
        return None
    if settings.webhook_secret is None:
        raise BadRequest(f"{WEBHOOK_URL}: webhooks are turned off here (no GATEWAY_WEBHOOK_SECRET)")
    if len(url) > MAX_WEBHOOK_URL:
        raise BadRequest(f"{WEBHOOK_URL}: {len(url)} characters; at most {MAX_WEBHOOK_URL}")
    if not url.isascii():  # header bytes arrive as latin-1: anything else would be another URL
        raise BadRequest(
            f"{WEBHOOK_URL}: non-ASCII bytes; send the host in IDNA (xn--) form and percent-encode the rest"
        )
    return await check_destination(
        url, WEBHOOK_URL, settings.webhook_allow_http, parse_allowlist(settings.webhook_allowlist)
    )
