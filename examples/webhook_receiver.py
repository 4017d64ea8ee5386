"""Submit a photo for offline classification and receive its result on a signed webhook.

    GATEWAY_WEBHOOK_SECRET=whsec_... python examples/webhook_receiver.py PHOTO \
        [--gateway http://127.0.0.1:8000] [--listen 127.0.0.1:9000] [--public-url URL] [--api-key KEY]

It starts a small HTTP receiver, submits PHOTO with ``mode=offline`` and ``Webhook-URL`` pointing
at the receiver, verifies the delivery's signature the Standard Webhooks way (HMAC-SHA256 of
``<webhook-id>.<webhook-timestamp>.<body>`` under the secret the gateway and its workers share;
the timestamp within 5 minutes), answers 204, and prints the result. A delivery whose signature
does not verify is answered 401 and not trusted. The gateway refuses to call loopback or private
addresses unless its ``GATEWAY_WEBHOOK_ALLOWLIST`` names them (and http needs
``GATEWAY_WEBHOOK_ALLOW_HTTP``): behind a public name, pass ``--public-url``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import json
import mimetypes
import os
import queue
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOLERANCE = 300
"""Seconds a delivery's timestamp may be from now (a replayed old delivery is refused)."""


def secret_bytes(secret: str) -> bytes:
    raw = secret.strip().removeprefix("whsec_")
    return base64.b64decode(raw + "=" * (-len(raw) % 4))


def verify(secret: bytes, headers: dict[str, str], body: bytes, now: float | None = None) -> bool:
    """Whether one of ``webhook-signature``'s ``v1,`` signatures is the body's, in time."""
    webhook_id, timestamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not timestamp.isdigit() or abs((now or time.time()) - int(timestamp)) > TOLERANCE:
        return False
    expected = hmac.new(secret, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    for signature in headers.get("webhook-signature", "").split():
        version, _, value = signature.partition(",")
        if version == "v1" and hmac.compare_digest(value.encode(), base64.b64encode(expected)):
            return True
    return False


def receiver(secret: bytes, deliveries: queue.Queue[dict[str, object]]) -> type[BaseHTTPRequestHandler]:
    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            headers = {name.lower(): value for name, value in self.headers.items()}
            if not verify(secret, headers, body):
                self.send_response(401)
                self.end_headers()
                return
            self.send_response(204)  # accepted: the gateway stops retrying
            self.end_headers()
            deliveries.put({"webhook-id": headers["webhook-id"], **json.loads(body)})

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Receiver


def submit(photo: Path, gateway: str, webhook_url: str, api_key: str | None) -> list[str]:
    request = urllib.request.Request(
        f"{gateway.rstrip('/')}/classify?mode=offline&top_k=3",
        data=photo.read_bytes(),
        headers={
            "Content-Type": mimetypes.guess_type(photo.name)[0] or "application/octet-stream",
            "Webhook-URL": webhook_url,
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return [job["job_id"] for job in json.load(answer)["jobs"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("photo", type=Path)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--listen", default="127.0.0.1:9000", help="address the receiver listens on")
    parser.add_argument("--public-url", help="the receiver's URL as the gateway's workers reach it")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the delivery")
    args = parser.parse_args(argv)
    secret = os.environ.get("GATEWAY_WEBHOOK_SECRET")
    if not secret:
        parser.error("set GATEWAY_WEBHOOK_SECRET to the gateway's webhook secret")
    host, _, port = args.listen.rpartition(":")
    deliveries: queue.Queue[dict[str, object]] = queue.Queue()
    server = ThreadingHTTPServer((host, int(port)), receiver(secret_bytes(secret), deliveries))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = args.public_url or f"http://{host}:{server.server_address[1]}/hook"
    try:
        (job_id,) = submit(args.photo, args.gateway, url, args.api_key)
        print(f"submitted job {job_id}; waiting for its webhook at {url}", file=sys.stderr)
        delivery = deliveries.get(timeout=args.timeout)
    except queue.Empty:
        print(f"no verified delivery within {args.timeout:g} s", file=sys.stderr)
        return 1
    finally:
        server.shutdown()
    print(json.dumps(delivery, indent=2))
    return 0 if delivery["webhook-id"] == job_id else 1


if __name__ == "__main__":
    sys.exit(main())
