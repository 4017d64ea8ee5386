"""Classify photos over gRPC with Triton's own client, as an application already written for Triton.

    pip install 'tritonclient[grpc]'
    python examples/classify_grpc.py PHOTO... [--url 127.0.0.1:8001] [--model efficientnet-lite0]
        [--top-k 3] [--api-key KEY] [--stream]

One call per photo (``--stream``: every photo on one bidirectional stream, answered as each
finishes); prints each photo's best labels as ``score:index:label``. A refusal prints the gRPC code
and the gateway's message and exits 1 (RESOURCE_EXHAUSTED: retry after the ``retry-after`` seconds).
"""

from __future__ import annotations

import argparse
import queue
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def inputs(photo: Path) -> list[grpcclient.InferInput]:
    image = grpcclient.InferInput("IMAGE", [1], "BYTES")  # the encoded photo: the gateway decodes it
    image.set_data_from_numpy(np.array([photo.read_bytes()], dtype=np.object_))
    return [image]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("photos", type=Path, nargs="+")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--api-key")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
    outputs = [grpcclient.InferRequestedOutput("PROBABILITIES", class_count=args.top_k)]
    client = grpcclient.InferenceServerClient(args.url)
    try:
        if not args.stream:
            for photo in args.photos:
                result = client.infer(args.model, inputs(photo), outputs=outputs, headers=headers)
                show(photo.name, result)
            return 0
        answers: queue.Queue[tuple[Any, InferenceServerException | None]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=headers)
        for i, photo in enumerate(args.photos):
            client.async_stream_infer(args.model, inputs(photo), outputs=outputs, request_id=str(i))
        failed = False
        for _ in args.photos:
            result, error = answers.get(timeout=60)
            if error is not None:
                print(f"refused: {error.message()}", file=sys.stderr)
                failed = True
            else:
                show(args.photos[int(result.get_response().id)].name, result)
        client.stop_stream()
        return 1 if failed else 0
    except InferenceServerException as exc:
        print(f"refused: {exc.status()} {exc.message()}", file=sys.stderr)
        return 1
    finally:
        client.close()


def show(name: str, result: Any) -> None:
    labels = [element.decode() for element in result.as_numpy("PROBABILITIES")[0]]
    print(f"{name}: {' | '.join(labels)}")


if __name__ == "__main__":
    sys.exit(main())
