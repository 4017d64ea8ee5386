"""The LitServe peer: ``POST /classify`` with the photo as multipart part ``file``; top 5 as JSON.

    PEER_MODEL=model.onnx PEER_LABELS=labels.txt python -m loadtests.peers.litserve_server --port 8000

(from the repository's root, in ``.venv-peers/litserve``; ``loadtests.harness.peers`` does this).

LitServe's own batching: the API server process parses the form and queues it; one inference
worker process collects up to ``max_batch_size`` requests, waiting at most ``batch_timeout``, and
runs ``decode_request`` on each, then ``batch``, ``predict``, ``unbatch`` and ``encode_response``.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import litserve as ls
import numpy as np
from fastapi import HTTPException

from loadtests.peers import job


class Classifier(ls.LitAPI):
    def setup(self, device: str) -> None:
        config = job.Config.from_env()
        self.session = job.open_session(config)
        self.labels = job.read_labels(config.labels)

    # `request` unannotated: LitServe makes the annotation the route's body type; without one the
    # route takes the request and hands its parsed form (starlette's FormData, pickled to this worker).
    def decode_request(self, request) -> np.ndarray:  # type: ignore[no-untyped-def]
        try:
            return job.prepare(request["file"].file.read())
        except (KeyError, AttributeError, job.BadPhoto) as e:
            # LitServe fails the whole batch this request is in (decode_request runs inside it)
            raise HTTPException(400, f"a JPEG in the form's part 'file' is needed: {e}") from e

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return job.infer(self.session, x)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"labels": job.top5(output, self.labels)}


_MAIN_PID = os.getpid()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl+C in the main process; quiet exit in a forked child that inherited this
    handler (uvicorn raises the SIGTERM that stopped it again once it has shut down)."""
    if os.getpid() != _MAIN_PID:
        raise SystemExit(128 + signum)
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    config = job.Config.from_env()
    api = Classifier(max_batch_size=config.max_batch, batch_timeout=config.max_wait_s, api_path="/classify")
    server = ls.LitServer(
        api,
        accelerator="cpu",
        # One inference worker, running one batch at a time on all the cores it may use (ONNX Runtime's
        # intra-op threads, PEER_THREADS): the same policy as the BentoML peer. More workers would each
        # hold a copy of the model and split the same cores.
        workers_per_device=1,
        timeout=config.timeout_s,  # a request still queued after this gets 504 (the gateway's request timeout)
        # answers come back over ZeroMQ, not a multiprocessing.Manager queue: LitServe's advice past 100 req/s
        fast_queue=True,
    )
    # LitServe stops its workers and its queues' manager on Ctrl+C; SIGTERM would end this process alone
    signal.signal(signal.SIGTERM, _interrupt)
    # One API server process (LitServe's default: as many as inference workers); no client.py written
    server.run(host=args.host, port=args.port, num_api_servers=1, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
