"""Submit a photo for offline classification and receive its result on a signed webhook.

    GATEWAY_WEBHOOK_SECRET=whsec_... python examples/webhook_receiver.py PHOTO \
        [--gateway http://127.0.0.1:8000] [--listen 127.0.0.1:9000] [--public-url URL] [--api-key KEY]

It starts a small HTTP receiver, submits PHOTO with ``mode=offline`` and ``Webhook-URL`` pointing
at the receiver, verifies the delivery's signature the Standard Webhooks way (HMAC-SHA256 of
``<webhook-id>.<webhook-timestamp>.<body>`` under the secret the gateway and its workers share;
the timestamp within 5 minutes), answers 204, and prints the result. A delivery whose signature
does not verify is answered 401 and not trusted.

What the gateway needs for it (offline mode, and webhooks to this machine):

* a broker and a worker: ``GATEWAY_BROKER_URL`` for ``gateway serve`` and a running ``gateway worker``
  (the worker delivers the webhook);
* the same ``GATEWAY_WEBHOOK_SECRET`` for both (``whsec_`` and base64, as Standard Webhooks secrets
  are) and for this script;
* for a receiver on loopback over http: ``GATEWAY_WEBHOOK_ALLOW_HTTP=true`` and
  ``GATEWAY_WEBHOOK_ALLOWLIST=127.0.0.1`` (the gateway refuses to call loopback or private addresses
  otherwise); behind a public https name, pass ``--public-url`` instead.

A refusal (no broker, a webhook URL the gateway will not call) prints the gateway's error and what
to set, and exits 1; a gateway it cannot reach is one line and exit status 2.
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
import urllib.error
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


def refusal(exc: urllib.error.HTTPError) -> str:
    """The gateway's refusal in one line, with what to set where it is the usual cause."""
    try:
        error = json.loads(exc.read() or b"{}")
    except ValueError:
        error = {}
    detail = str(error.get("detail") or exc.reason)
    hint = ""
    if "GATEWAY_BROKER_URL" in detail:
        hint = " (start the gateway with GATEWAY_BROKER_URL, and a `gateway worker`)"
    elif "Webhook-URL" in detail and "GATEWAY_WEBHOOK_SECRET" not in detail:
        hint = " (for a receiver on this machine: GATEWAY_WEBHOOK_ALLOW_HTTP=true GATEWAY_WEBHOOK_ALLOWLIST=127.0.0.1)"
    return f"{exc.code} {error.get('error', 'error')}: {detail}{hint}"


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
    try:
        server = ThreadingHTTPServer((host, int(port)), receiver(secret_bytes(secret), deliveries))
    except (OSError, ValueError) as exc:
        print(f"cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = args.public_url or f"http://{host}:{server.server_address[1]}/hook"
    try:
        (job_id,) = submit(args.photo, args.gateway, url, args.api_key)
        print(f"submitted job {job_id}; waiting for its webhook at {url}", file=sys.stderr)
        delivery = deliveries.get(timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        print(refusal(exc), file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"cannot reach the gateway at {args.gateway}: {exc.reason} (is it running?)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cannot read {args.photo}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except queue.Empty:
        print(
            f"no verified delivery within {args.timeout:g} s (is a `gateway worker` running, with the same "
            "GATEWAY_WEBHOOK_SECRET?)",
            file=sys.stderr,
        )
        return 1
    finally:
        server.shutdown()
    print(json.dumps(delivery, indent=2))
    return 0 if delivery["webhook-id"] == job_id else 1


if __name__ == "__main__":
    sys.exit(main())
