"""Classify a photo with nothing but Python's standard library.

    python examples/classify.py PHOTO [--gateway http://127.0.0.1:8000] [--top-k 3] [--api-key KEY]

Prints one line per label: score and name. A refused request (an image the gateway cannot read,
a quota, a full queue) prints the gateway's error and exits 1; a 429 or 503 says when to retry.
"""

from __future__ import annotations

import argparse
import json
import mimetypes
import sys
import urllib.error
import urllib.request
from pathlib import Path


def classify(photo: Path, gateway: str, top_k: int, api_key: str | None) -> dict[str, object]:
    media = mimetypes.guess_type(photo.name)[0] or "application/octet-stream"
    request = urllib.request.Request(
        f"{gateway.rstrip('/')}/classify?top_k={top_k}",
        data=photo.read_bytes(),
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
        answer = classify(args.photo, args.gateway, args.top_k, args.api_key)
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read() or b"{}")
        retry = exc.headers.get("Retry-After")
        print(
            f"{exc.code} {error.get('error')}: {error.get('detail')}" + (f" (retry after {retry} s)" if retry else "")
        )
        return 1
    for label in answer["results"][0]["labels"]:  # type: ignore[index]
        print(f"{label['score']:.3f}  {label['label']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
