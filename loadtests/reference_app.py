"""The floor the gateway is measured against: a minimal FastAPI app that reads the body, decodes and
resizes it with OpenCV in a thread pool, and answers a small JSON. No batching, no model, no
metrics, no admission control: what any Python image service on this stack costs per request.

    python -m loadtests.reference_app --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import uvicorn
from fastapi import FastAPI, Request


def _prepare(data: bytes) -> int:
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None:
        return -1
    small = cv2.resize(img, (224, 224), interpolation=cv2.INTER_AREA)
    return int(small[0, 0, 0])


def create_reference_app() -> FastAPI:
    cv2.setNumThreads(1)
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    app = FastAPI()

    @app.post("/classify")
    async def classify(request: Request) -> dict[str, object]:
        body = await request.body()
        value = await asyncio.get_running_loop().run_in_executor(pool, _prepare, body)
        return {"results": [{"labels": [{"index": value, "score": 1.0}]}]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    uvicorn.run(create_reference_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
