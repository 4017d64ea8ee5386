"""Offline mode with several models, against the real RabbitMQ: a queue per model, workers that
serve the models they are given, jobs that name their version, idempotency per model, ingest
``--model``, and jobs naming what a worker does not serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import aio_pika
import httpx
import pytest

from service.jobs.assignment import NOT_SERVED_REQUEUES
from service.jobs.messages import ERROR_HEADER, MODEL_HEADER, REQUEUES_HEADER, VERSION_HEADER
from service.jobs.policies import gateway_policies, rabbitmqctl_commands
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import CAT_CLASSES, png_bytes, running_gateway, solid_image
from tests.jobs.conftest import (
    BROKER_URL,
    broker_ok,
    class_pngs,
    collect_results,
    drain,
    gateway_process,
    job,
    publish,
    queue_depth,
    wait_for_line,
)

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
PNG = {"content-type": "image/png"}
MODELS = """
default = "photos"
[models.photos]
profile = "trivial"
backend = "fake"
[models.shop]
profile = "trivial"
backend = "fake"
[models.shop.versions.1]
traffic = 100
[models.shop.versions.2]
traffic = 0
"""


def _models_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(textwrap.dedent(MODELS))
    return path


def _settings(make: MakeSettings, prefix: str, **kw: object) -> Settings:
    return make(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, **kw)


def _png(value: int) -> bytes:
    return png_bytes(solid_image(value, 8))


async def _job(client: httpx.AsyncClient, job_id: str, timeout: float = 60) -> dict[str, object]:
    async with asyncio.timeout(timeout):
        while (body := (await client.get(f"/jobs/{job_id}")).json())["status"] == "pending":  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return body  # type: ignore[no-any-return]


def _depth(metrics: Metrics, queue: str) -> float | None:
    """``gateway_queue_depth_messages`` of ``queue`` (None: never sampled)."""
    return metrics.registry.get_sample_value("gateway_queue_depth_messages", {"queue": queue})


async def _submit(client: httpx.AsyncClient, path: str, value: int, **headers: str) -> httpx.Response:
    return await client.post(path, params={"mode": "offline"}, content=_png(value), headers={**PNG, **headers})


async def test_each_model_has_its_queue_and_its_workers(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """``/classify`` jobs go to ``<prefix>.work``, ``/v1/models/shop/...`` jobs to
    ``<prefix>.work.shop``. A worker given ``shop`` alone takes only those, each at the version it
    names (2, though 2 takes no traffic) or one picked by weight (1), while the default model's job
    waits; a worker for the default model then takes that one."""
    settings = _settings(gateway_factory, prefix, models_file=_models_file(tmp_path))
    names = Names(prefix)
    async with running_gateway(settings) as client:
        await broker_ok(client)
        default = await _submit(client, "/classify", 3)
        shop = await _submit(client, "/v1/models/shop/classify", 4)
        pinned = await _submit(client, "/v1/models/shop/versions/2/classify", 5)
        assert [r.status_code for r in (default, shop, pinned)] == [202, 202, 202], pinned.text
        assert await queue_depth(names.work) == 1
        assert await queue_depth(f"{names.work}.shop") == 2
        (default_id, shop_id, pinned_id) = (r.json()["jobs"][0]["job_id"] for r in (default, shop, pinned))

        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings.model_copy(update={"worker_models": "shop"}), stop))
        shop_done, pinned_done = await _job(client, shop_id), await _job(client, pinned_id)
        assert (await client.get(f"/jobs/{default_id}")).json()["status"] == "pending"
        stop.set()
        await worker
        assert await queue_depth(names.work) == 1  # untouched by the shop worker

        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop))  # worker_models empty: the default model
        default_done = await _job(client, default_id)
        stop.set()
        await worker
    assert shop_done["model"]["name"] == "shop"
    assert shop_done["model"]["version"] == "1"
    assert pinned_done["model"]["version"] == "2"  # type: ignore[index]
    assert default_done["model"]["name"] == "photos"  # type: ignore[index]
    for done, value in ((default_done, 3), (shop_done, 4), (pinned_done, 5)):
        assert done["status"] == "done"
        assert done["labels"][0]["index"] == value


async def test_two_real_models_offline_on_one_worker(
    gateway_factory: MakeSettings, prefix: str, cat_jpeg: bytes
) -> None:
    """EfficientNet-Lite0 (the default) and the trivial model on the embedded backend: the same cat
    photo queued for each, one worker serving both (``*``); each result comes from its model."""
    settings = _settings(gateway_factory, prefix, models="efficientnet-lite0,trivial", worker_models="*")
    jpeg = {"content-type": "image/jpeg"}
    async with running_gateway(settings) as client:
        await broker_ok(client)
        queued = [
            await client.post(path, params={"mode": "offline"}, content=cat_jpeg, headers=jpeg)
            for path in ("/classify", "/v1/models/trivial/classify")
        ]
        assert [r.status_code for r in queued] == [202, 202], queued[1].text
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop))
        results = [await _job(client, r.json()["jobs"][0]["job_id"]) for r in queued]
        stop.set()
        await worker
    efficientnet, trivial = results
    assert efficientnet["model"]["name"] == "efficientnet-lite0"  # type: ignore[index]
    assert efficientnet["labels"][0]["index"] in CAT_CLASSES  # type: ignore[index]
    assert trivial["model"]["name"] == "trivial"
    assert trivial["status"] == "done"
    assert len(trivial["labels"]) == 5  # type: ignore[arg-type]


async def test_jobs_a_worker_does_not_serve_are_moved_requeued_or_failed(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """Jobs on ``shop``'s queue, taken by a worker that serves shop alone:

    * one naming the default model (``photos``, whose queue is another: the default changed while
      it waited) is moved to ``<prefix>.work`` at once, its headers and counts kept;
    * one naming a version shop does not have, or a model the gateway does not serve, goes back to
      shop's queue (``x-requeues`` + 1) for a worker that does: neither failed nor dead-lettered;
    * the same after ``NOT_SERVED_REQUEUES`` requeues fails as ``model_not_served``, dead-lettered;
    * model or version headers that are not names (a number, 65 characters, a version "01") fail
      as bad requests, dead-lettered once, naming the header;
    * a good job among them is classified by shop."""
    settings = _settings(gateway_factory, prefix, models_file=_models_file(tmp_path), worker_models="shop")
    names = Names(prefix)
    route = names.route("shop", "photos")
    jobs = {f"j{i}": job(i, f"j{i}") for i in range(1, 9)}
    headers = {job_id: message.headers for job_id, message in jobs.items()}
    headers["j1"][MODEL_HEADER] = "photos"  # type: ignore[index]
    headers["j2"][VERSION_HEADER] = "9"  # type: ignore[index]
    headers["j3"][MODEL_HEADER] = "nope"  # type: ignore[index]
    headers["j4"].update({VERSION_HEADER: "9", REQUEUES_HEADER: NOT_SERVED_REQUEUES})  # type: ignore[union-attr]
    headers["j5"][MODEL_HEADER] = 7  # type: ignore[index]
    headers["j6"][MODEL_HEADER] = "x" * 65  # type: ignore[index]
    headers["j7"][VERSION_HEADER] = "01"  # type: ignore[index]
    await publish(names, *jobs.values(), route=route)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    results = await collect_results(names, 5)  # j4-j8
    await asyncio.sleep(0.5)  # the unserved ones each go round at least once
    stop.set()
    await worker
    by_id = {r.job_id: r for r in results}
    assert set(by_id) == {"j4", "j5", "j6", "j7", "j8"}
    assert by_id["j8"].status == "done"
    assert by_id["j8"].model is not None
    assert by_id["j8"].model.name == "shop"
    assert by_id["j4"].error is not None
    assert by_id["j4"].error.error == "model_not_served"
    assert "version '9' of model 'shop'" in by_id["j4"].error.detail
    for bad, header in (("j5", MODEL_HEADER), ("j6", MODEL_HEADER), ("j7", VERSION_HEADER)):
        assert by_id[bad].status == "failed"
        assert by_id[bad].error is not None
        assert by_id[bad].error.error == "bad_request"
        assert f"bad message header: {header}=" in by_id[bad].error.detail
    dead = {m.message_id: m.headers[ERROR_HEADER] for m in await drain(names.dead)}
    assert dead == {"j4": "model_not_served", "j5": "bad_request", "j6": "bad_request", "j7": "bad_request"}
    back = {m.message_id: m.headers for m in await drain(route.queue)}
    assert set(back) == {"j2", "j3"}  # not failed, not lost: back in shop's queue
    assert back["j2"][VERSION_HEADER] == "9"
    assert back["j3"][MODEL_HEADER] == "nope"
    assert all(int(h[REQUEUES_HEADER]) >= 1 for h in back.values())
    (moved,) = await drain(names.work)
    assert moved.message_id == "j1"
    assert moved.headers is not None
    assert moved.headers[MODEL_HEADER] == "photos"
    assert REQUEUES_HEADER not in moved.headers  # moved, not requeued: no backoff, nothing counted


async def test_a_new_default_model_keeps_its_old_queue(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """The models file's default changes from photos to shop. Shop's jobs in ``<prefix>.work.shop``
    (queued before the change, or sent there by an API replica still on the old file during the
    rolling update) are not stranded: a worker serving shop declares that queue, samples its depth
    (``gateway_queue_depth_messages``) and classifies its jobs."""
    models = tmp_path / "models.toml"
    models.write_text(textwrap.dedent(MODELS).replace('default = "photos"', 'default = "shop"'))
    settings = _settings(gateway_factory, prefix, models_file=models)
    names = Names(prefix)
    old_queue = names.route("shop", "photos")  # shop's queue while photos was the default
    assert old_queue.queue == f"{names.work}.shop"
    metrics = Metrics()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, metrics=metrics))  # serves the default: shop
    try:
        async with asyncio.timeout(20):
            while _depth(metrics, old_queue.queue) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        message = job(3, "late")
        assert message.headers is not None
        message.headers[MODEL_HEADER] = "shop"
        connection = await aio_pika.connect(BROKER_URL)
        async with connection:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.get_exchange(names.requests)
            await exchange.publish(message, old_queue.key, mandatory=True)  # as the old API replica does
        (result,) = await collect_results(names, 1, timeout=20)
    finally:
        stop.set()
        await worker
    assert result.status == "done"
    assert result.model is not None
    assert result.model.name == "shop"
    assert result.labels[0].index == 3


async def test_an_idempotency_key_names_its_model_and_version(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """The default model by ``/classify`` or by its name is one target: the same key and body
    replay. The same key and body for another model, or for a version of the default, is another
    request: 409, and nothing more is queued."""
    settings = _settings(gateway_factory, prefix, models_file=_models_file(tmp_path))
    names = Names(prefix)
    key = {"idempotency-key": "one-key"}
    async with running_gateway(settings) as client:
        await broker_ok(client)
        first = await _submit(client, "/classify", 3, **key)
        again = await _submit(client, "/v1/models/photos/classify", 3, **key)
        other_model = await _submit(client, "/v1/models/shop/classify", 3, **key)
        other_version = await _submit(client, "/v1/models/photos/versions/1/classify", 3, **key)
    assert first.status_code == 202
    assert again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert other_model.status_code == 409
    assert other_model.json()["error"] == "idempotency_conflict"
    assert other_version.status_code == 409
    assert await queue_depth(names.work) == 1
    assert await queue_depth(f"{names.work}.shop") == 0


def test_ingest_model_sends_a_folder_to_that_models_workers(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """``gateway ingest --model shop --model-version 2``: every image classified by shop's version 2
    (a worker process given ``shop``); a model or version that is not served is refused at once."""
    pngs = class_pngs(tmp_path / "photos", 12)
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_MODELS_FILE": str(_models_file(tmp_path)),
        "GATEWAY_WORKER_METRICS_PORT": "0",
    }
    ingest = [sys.executable, "-m", "service", "ingest", str(tmp_path / "photos"), "--out", str(tmp_path / "out.jsonl")]
    refused = [
        subprocess.run([*ingest, *extra], env=env, capture_output=True, text=True, timeout=60)
        for extra in (["--model", "nope"], ["--model", "shop", "--model-version", "7"], ["--model", "Shop!"])
    ]
    log = tmp_path / "worker.log"
    worker = gateway_process(["worker"], {**env, "GATEWAY_WORKER_MODELS": "shop"}, log)
    try:
        wait_for_line(log, "worker ready")
        done = subprocess.run(
            [*ingest, "--model", "shop", "--model-version", "2"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    assert [r.returncode for r in refused] == [1, 1, 1]
    assert "no model 'nope' is served (the models are photos, shop)" in refused[0].stderr
    assert "model 'shop' has no version '7' (it has 1, 2)" in refused[1].stderr
    assert "'Shop!' is not a model name" in refused[2].stderr
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(results) == 12
    assert {(r["model"]["name"], r["model"]["version"]) for r in results} == {("shop", "2")}
    assert all(r["labels"][0]["index"] == pngs[Path(r["path"])] for r in results)


def test_the_work_policy_covers_every_models_queue(prefix: str) -> None:
    """``gateway queues policies``' work policy (delivery limit, dead-letter exchange) applies to
    each model's queue as to ``<prefix>.work``, and to no other queue of the gateway's."""
    names = Names(prefix)
    routes = names.routes(["photos", "shop", "v2.model"], "photos")
    asyncio.run(publish(names, route=routes[1]))
    asyncio.run(publish(names, route=routes[2]))
    commands = rabbitmqctl_commands(gateway_policies(names, 3))
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        listed = subprocess.run(
            ["rabbitmqctl", "list_queues", "-q", "name", "policy"], check=True, capture_output=True, text=True
        ).stdout
    finally:
        for policy in gateway_policies(names, 3):
            subprocess.run(["rabbitmqctl", "clear_policy", policy.name], capture_output=True)
    rows = (line.partition("\t") for line in listed.splitlines() if line.startswith(prefix + "."))
    policies = {name: policy.strip() for name, _, policy in rows}
    work = f"{prefix}-work"
    assert policies[names.work] == policies[f"{names.work}.shop"] == policies[f"{names.work}.v2.model"] == work
    assert policies[names.dead] != work
    assert policies[names.webhooks] == f"{prefix}-webhooks"


def test_a_worker_given_models_not_served_refuses_to_start(tmp_path: Path, prefix: str, models_dir: Path) -> None:
    """``GATEWAY_WORKER_MODELS`` naming a model the models file does not (a typo, a path-like name)
    stops ``gateway worker`` at once with the names it knows, before it takes any job."""
    env = {
        **os.environ,
        "GATEWAY_BROKER_URL": BROKER_URL,
        "GATEWAY_QUEUE_PREFIX": prefix,
        "GATEWAY_MODELS_DIR": str(models_dir),
        "GATEWAY_MODELS_FILE": str(_models_file(tmp_path)),
        "GATEWAY_WORKER_METRICS_PORT": "0",
        "GATEWAY_WORKER_MODELS": "shop,../photos",
    }
    done = subprocess.run(
        [sys.executable, "-m", "service", "worker"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "worker_models names '../photos', not among the models served (photos, shop)" in done.stderr
    assert "Traceback" not in done.stderr
