"""The BentoML peer: ``POST /classify`` with the photo as multipart part ``file``; top 5 as JSON.

    PEER_MODEL=model.onnx PEER_LABELS=labels.txt \
        bentoml serve loadtests.peers.bentoml_service:Classifier --working-dir . --port 8000

(from the repository's root, in ``.venv-peers/bentoml``; ``loadtests.harness.peers`` does this).

BentoML's own batching: a batchable API takes a list; its adaptive dispatcher (the "cork"
algorithm) gathers the lists of concurrent requests into one call of at most ``max_batch_size``
items, one call at a time per worker. It has no fixed wait to set: it learns the batch's duration
and how long waiting pays, and ``max_latency_ms`` is a deadline, past which queued requests get 503.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bentoml
import numpy as np

from loadtests.peers import job

CONFIG = job.Config.from_env()


@bentoml.service(
    # One worker process, running one batch at a time on all the cores it may use (ONNX Runtime's
    # intra-op threads, PEER_THREADS): the same policy as the LitServe peer.
    workers=1,
    traffic={"timeout": CONFIG.timeout_s},
    logging={"access": {"enabled": False}},  # no line per request: neither the gateway nor LitServe logs one
)
class Classifier:
    def __init__(self) -> None:
        self.session = job.open_session(CONFIG)
        self.labels = job.read_labels(CONFIG.labels)

    # The gateway's request timeout as the dispatcher's deadline: BentoML's batch window is adaptive,
    # so PEER_MAX_WAIT_S has no counterpart here.
    @bentoml.api(batchable=True, max_batch_size=CONFIG.max_batch, max_latency_ms=int(CONFIG.timeout_s * 1000))
    def classify(self, file: list[Path]) -> list[dict[str, Any]]:
        # multipart part "file": BentoML writes each upload to a temporary file and hands its path
        images = np.stack([job.prepare(path.read_bytes()) for path in file])
        return [{"labels": job.top5(row, self.labels)} for row in job.infer(self.session, images)]
