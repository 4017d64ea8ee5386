"""Job ids that name their owner: a job's results go to the API key that submitted it.

An id is 32 hex digits of ``nonce`` and 32 of ``tag = HMAC-SHA256(owner secret, nonce)``, where the
owner secret is the submitting API key itself (empty without API keys). So the owner travels
wherever the id goes (request and result messages, webhooks, every API replica's job store) with
nothing added to the messages, and any replica checks it from the id alone: ``GET /jobs/{id}``
with another key finds the tag wrong and answers the same 404 as for an unknown job. Only the
gateway and the key's holder can make or recognise a key's ids; the key's public id (on
``/metrics``, in logs) opens nothing.

The nonce is random for a plain submit, and for an idempotent one an HMAC under the same secret of
(idempotency key, the request's fingerprint, the image's index): a retry gets the same ids on any
replica, the same key with another body (after its TTL) gets new ones, and nobody without the API
key can compute them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16
JOB_ID_CHARS = 4 * NONCE_BYTES
"""Hex digits of a job id: the nonce's, then the tag's."""


def _tag(owner: bytes, nonce: bytes) -> bytes:
    return hmac.new(owner, b"gateway-job-owner\0" + nonce, hashlib.sha256).digest()[:NONCE_BYTES]


def job_id(owner: bytes, nonce: bytes) -> str:
    return (nonce + _tag(owner, nonce)).hex()


def fresh_job_id(owner: bytes) -> str:
    """A fresh job id of ``owner`` (an API key's secret, b"" without keys)."""
    return job_id(owner, secrets.token_bytes(NONCE_BYTES))


def derived_job_ids(owner: bytes, key: str, fingerprint: bytes, count: int) -> list[str]:
    """The ids of an idempotent submit: the same for a retry of the same request by the same owner."""
    base = hmac.new(owner, b"gateway-job-id\0" + key.encode() + b"\0" + fingerprint, hashlib.sha256)
    ids = []
    for index in range(count):
        nonce = base.copy()
        nonce.update(index.to_bytes(4, "big"))
        ids.append(job_id(owner, nonce.digest()[:NONCE_BYTES]))
    return ids


def owns(owner: bytes, job: str) -> bool:
    """Whether ``job`` was made for ``owner``, in constant time."""
    if len(job) != JOB_ID_CHARS:
        return False
    try:
        raw = bytes.fromhex(job)
    except ValueError:
        return False
    return hmac.compare_digest(raw[NONCE_BYTES:], _tag(owner, raw[:NONCE_BYTES]))
