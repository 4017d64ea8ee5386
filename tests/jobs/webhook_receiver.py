"""A webhook receiver on loopback that verifies every request with the Standard Webhooks reference
library (``standardwebhooks``), for the webhook tests on one broker and on a cluster."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
LOOPBACK = {"webhook_secret": SECRET, "webhook_allow_http": True, "webhook_allowlist": "127.0.0.1/32"}
Decide = Callable[[str, int], int | None]
"""(webhook id, its attempt number from 1) -> the status to answer, or None to hang."""


class Receiver:
    """Counts attempts and accepted deliveries per webhook id; a request whose signature the
    reference library refuses is answered 400 and counted."""

    def __init__(self, decide: Decide) -> None:
        self.decide = decide
        self.verifier = Webhook(SECRET)
        self.attempts: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.payloads: dict[str, dict[str, Any]] = {}
        self.bad_signatures = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        webhook_id = request.headers.get("webhook-id", "")
        self.attempts[webhook_id] += 1
        try:
            payload = self.verifier.verify(body, dict(request.headers))
        except WebhookVerificationError:
            self.bad_signatures += 1
            return web.Response(status=400)
        status = self.decide(webhook_id, self.attempts[webhook_id])
        if status is None:
            await asyncio.sleep(60)
            return web.Response(status=503)
        if 200 <= status < 300:
            self.accepted[webhook_id] += 1
            self.payloads[webhook_id] = payload
        return web.Response(status=status)

    async def until(self, done: Callable[[], bool], timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while not done():  # noqa: ASYNC110
                await asyncio.sleep(0.05)


@asynccontextmanager
async def receiving(decide: Decide, host: str = "127.0.0.1") -> AsyncIterator[Receiver]:
    receiver = Receiver(decide)
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    receiver.url = f"http://{host}:{port}/hook"
    try:
        yield receiver
    finally:
        await runner.cleanup()
