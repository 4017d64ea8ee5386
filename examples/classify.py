"""Classify a photo with nothing but Python's standard library.

    python examples/classify.py PHOTO [--gateway http://127.0.0.1:8000] [--top-k 3] [--api-key KEY]

Prints one line per label: score and name. A refused request (an image the gateway cannot read,
a quota, a full queue) prints the gateway's error and exits 1; a 429 or 503 says when to retry. A
gateway it cannot reach, or a photo it cannot read, is one line on stderr and exit status 2.
Needs only a running gateway (``scripts/serve``).
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import sys
import urllib.error
import urllib.request
from pathlib import Path


def classify(photo: bytes, name: str, gateway: str, top_k: int, api_key: str | None) -> dict[str, object]:
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    request = urllib.request.Request(
        f"{gateway.rstrip('/')}/classify?top_k={top_k}",
        data=photo,
        headers={"Content-Type": media, **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("photo", type=Path)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)
    try:
        photo = args.photo.read_bytes()
    except OSError as exc:
        print(f"cannot read {args.photo}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        answer = classify(photo, args.photo.name, args.gateway, args.top_k, args.api_key)
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read() or b"{}")
        except ValueError:  # not JSON (a proxy's page, say)
            error = None
        if not isinstance(error, dict):  # not the gateway's JSON error
            error = {"error": exc.reason, "detail": "the answer was not the gateway's JSON"}
        retry = exc.headers.get("Retry-After")
        print(
            f"{exc.code} {error.get('error')}: {error.get('detail')}" + (f" (retry after {retry} s)" if retry else "")
        )
        return 1
    except (urllib.error.URLError, OSError) as exc:  # nothing listens, a wrong host, a reset, a timeout
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc.strerror or exc
        print(f"cannot reach the gateway at {args.gateway}: {reason} (is it running? scripts/serve)", file=sys.stderr)
        return 2
    except ValueError as exc:  # an answer that is not JSON, or a URL that is not one
        print(f"no answer from a gateway at {args.gateway}: {exc}", file=sys.stderr)
        return 2
    for label in answer["results"][0]["labels"]:  # type: ignore[index]
        print(f"{label['score']:.3f}  {label['label']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
