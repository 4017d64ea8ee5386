"""The floor the gateway is measured against: a minimal FastAPI app that reads the body, decodes and
resizes it with OpenCV in a thread pool, and answers a small JSON. No batching, no model, no
metrics, no admission control: what any Python image service on this stack costs per request.

With ``--preprocess gateway`` it does the gateway's image work instead (``service.images.preprocess.prepare``:
the header checks, the model's centre crop and the resize), so that work's cost can be told apart
from the rest of the gateway's: on a 224 px JPEG the minimal resize is a copy, while the model's
crop (0.875 of the side) has to be scaled back up to 224.

    python -m loadtests.harness.reference_app --port 8100 [--preprocess gateway]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import uvicorn
from fastapi import FastAPI, Request

from service.images.preprocess import PreprocessConfig, prepare


def _prepare(data: bytes) -> int:
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        return -1
    small = cv2.resize(img, (224, 224), interpolation=cv2.INTER_AREA)
    return int(small[0, 0, 0])


GATEWAY_CONFIG = PreprocessConfig()
"""The gateway's defaults for a 224 px model (the trivial model's: crop 0.875)."""


SAME_WORK = "reference doing the gateway's image work (header checks, centre crop, resize)"
"""The name of this app's row with ``--preprocess gateway`` in ``loadtests.serving_path``'s table."""


def _prepare_as_the_gateway(data: bytes) -> int:
    return int(prepare(data, GATEWAY_CONFIG)[0, 0, 0])


def create_reference_app(preprocess: str = "minimal") -> FastAPI:
    work: Callable[[bytes], int] = _prepare_as_the_gateway if preprocess == "gateway" else _prepare
    cv2.setNumThreads(1)
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    app = FastAPI()

    @app.post("/classify")
    async def classify(request: Request) -> dict[str, object]:
        body = await request.body()
        value = await asyncio.get_running_loop().run_in_executor(pool, work, body)
        return {"results": [{"labels": [{"index": value, "score": 1.0}]}]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--preprocess", choices=("minimal", "gateway"), default="minimal")
    args = parser.parse_args()
    uvicorn.run(
        create_reference_app(args.preprocess), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
