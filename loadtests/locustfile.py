"""HTTP load with Locust, a real third-party client: users post JPEGs to /classify.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000                  (web UI on :8089)
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless -u 64 -r 16 -t 60s

Environment: GATEWAY_BENCH_IMAGES (a folder of images, e.g. from loadtests.harness.dataset; default: the
scikit-image sample photos), GATEWAY_API_KEY, GATEWAY_TOP_K (5). A 429 is reported as its own
failure ("queue full") so shedding shows apart from errors.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from locust import FastHttpUser, constant, task

from loadtests.harness.photos import sample_photos


def _images() -> list[bytes]:
    folder = os.environ.get("GATEWAY_BENCH_IMAGES")
    if folder:
        files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})
        return [p.read_bytes() for p in files[:5000]]
    return [data for _, data in sample_photos()]


IMAGES = _images()
HEADERS = {"content-type": "image/jpeg"}
if os.environ.get("GATEWAY_API_KEY"):
    HEADERS["authorization"] = f"Bearer {os.environ['GATEWAY_API_KEY']}"
TOP_K = os.environ.get("GATEWAY_TOP_K", "5")


class ClassifyUser(FastHttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.images = itertools.cycle(IMAGES)

    @task
    def classify(self) -> None:
        with self.client.post(
            f"/classify?top_k={TOP_K}",
            data=next(self.images),  # type: ignore[arg-type]  # bytes are sent as is; the stubs say str
            headers=HEADERS,
            name="/classify",
            catch_response=True,
        ) as response:
            if response.status_code == 429:
                response.failure("queue full (429)")
            elif response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
            elif not response.json().get("results"):
                response.failure("200 without results")
            else:
                response.success()
