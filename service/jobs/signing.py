"""Signing of completion webhooks the Standard Webhooks way (https://www.standardwebhooks.com).

The secret is ``whsec_`` + base64 of 24-64 random bytes; the signature of one attempt is ``v1,`` +
base64 HMAC-SHA256 of ``<webhook-id>.<webhook-timestamp>.<body>`` under those bytes, which the
spec's libraries (``standardwebhooks`` on PyPI, npm, Go, ...) verify as they are.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

SECRET_PREFIX = "whsec_"


def parse_secret(text: str) -> bytes:
    """The key of ``whsec_<base64>`` (the prefix optional, padding too, as the spec's libraries read it)."""
    raw = text.strip().removeprefix(SECRET_PREFIX)
    try:
        secret = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("webhook_secret must be base64, optionally after 'whsec_'") from None
    if len(secret) < 24:
        raise ValueError(f"webhook_secret holds {len(secret)} bytes; at least 24 (32 recommended)")
    return secret


def signature(secret: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()
