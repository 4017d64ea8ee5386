"""Offline jobs of each output kind through a real worker and RabbitMQ: an embedding model's job
carries its vector (``embedding``), a sigmoid model's the labels at or above its threshold, in the
job's state and in the result message (what webhooks and ``gateway ingest`` pass on)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.jobs.messages import request_message
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from tests.conftest import running_gateway
from tests.http.test_output_kinds import (
    EMBEDDER,
    RED,
    TAGGER,
    TEAL,
    catalog_of,
    embedder_graph,
    rows,
    settings_for,
    solid_png,
    tagger_graph,
)
from tests.jobs.conftest import BROKER_URL, broker_ok, collect_results, publish

pytestmark = pytest.mark.rabbitmq


async def done(client: httpx.AsyncClient, job_id: str) -> dict[str, object]:
    async with asyncio.timeout(60):
        while (status := (await client.get(f"/jobs/{job_id}")).json())["status"] == "pending":  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert status["status"] == "done", status
    return status  # type: ignore[no-any-return]


async def test_offline_jobs_carry_what_their_model_gives(tmp_path: Path, prefix: str) -> None:
    """/embed?mode=offline queues one job per image; the worker embeds each (ONNX Runtime) and its
    state holds the vector, equal as float32 to the model's row, and no labels. A sigmoid model's
    offline job holds the labels at or above 0.5 (top_k caps) and no embedding. /classify?mode=offline
    of the embedding model is refused at submit."""
    settings = settings_for(
        tmp_path, broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, worker_models="*"
    )
    catalog = catalog_of(settings, ("emb", EMBEDDER), ("tags", TAGGER))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, catalog=catalog))
    try:
        async with running_gateway(settings, catalog=catalog) as client:
            await broker_ok(client)
            files = [
                ("file", ("red.png", solid_png(RED), "image/png")),
                ("file", ("teal.png", solid_png(TEAL), "image/png")),
            ]
            queued = await client.post("/v1/models/emb/embed", params={"mode": "offline"}, files=files)
            assert queued.status_code == 202, queued.text
            tagged = await client.post(
                "/v1/models/tags/classify",
                params={"mode": "offline", "top_k": 20},
                content=solid_png((100, 0, 0)),
                headers={"content-type": "image/png"},
            )
            assert tagged.status_code == 202, tagged.text
            refused = await client.post(
                "/classify", params={"mode": "offline"}, content=solid_png(RED), headers={"content-type": "image/png"}
            )
            embedded = [await done(client, job["job_id"]) for job in queued.json()["jobs"]]
            (tags,) = [await done(client, job["job_id"]) for job in tagged.json()["jobs"]]
    finally:
        stop.set()
        await worker
    expected = rows(embedder_graph(), RED, TEAL)
    assert [job["filename"] for job in embedded] == ["red.png", "teal.png"]
    assert all(job["labels"] == [] for job in embedded)
    vectors = np.array([job["embedding"] for job in embedded], np.float64).astype(np.float32)
    assert np.array_equal(vectors, expected)
    assert tags["embedding"] is None
    (red_row,) = rows(tagger_graph(), (100, 0, 0))
    indices = [label["index"] for label in tags["labels"]]  # type: ignore[attr-defined]
    assert indices == [j for j in sorted(range(len(red_row)), key=lambda j: (-red_row[j], j)) if red_row[j] >= 0.5]
    assert len(indices) == 11
    assert refused.status_code == 400
    assert refused.json()["error"] == "not_a_classifier"


async def test_a_result_message_carries_the_embedding(tmp_path: Path, prefix: str) -> None:
    """A job published straight to the embedding model's queue (as ``gateway ingest`` does, with a
    top_k it does not use): its result message on the results queue carries the vector."""
    settings = settings_for(tmp_path, broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0)
    catalog = catalog_of(settings, ("emb", EMBEDDER))
    names = Names(prefix)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, catalog=catalog))
    try:
        message = request_message(
            solid_png(TEAL), job_id="emb-1", content_type="image/png", filename="t.png", top_k=3, reply_to="jobs"
        )
        await publish(names, message)
        (result,) = await collect_results(names, 1)
    finally:
        stop.set()
        await worker
    assert (result.job_id, result.status, result.labels) == ("emb-1", "done", [])
    assert result.embedding is not None
    assert np.array_equal(np.array(result.embedding, np.float32), rows(embedder_graph(), TEAL)[0])
