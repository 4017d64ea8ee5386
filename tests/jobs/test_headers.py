"""A job message's headers, read and checked before the job is handled (``service.jobs.headers``),
against a real worker and the real RabbitMQ: what a job asks for is kept on every copy of it (a
move to its model's queue, a requeue), and no header value is a way around a cap. Out-of-range
values of each numeric header are also among ``test_hostile_amqp``'s cases."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from service.jobs.messages import ERROR_HEADER, MODEL_HEADER, REQUEUES_HEADER, VERSION_HEADER
from service.jobs.topology import Names
from service.jobs.worker import run_worker
from service.metrics import Metrics
from service.settings import Settings
from tests.jobs.conftest import BROKER_URL, collect_results, drain, job, publish, queue_depth

pytestmark = pytest.mark.rabbitmq

MakeSettings = Callable[..., Settings]
MODELS = """
default = "photos"
[models.photos]
profile = "trivial"
backend = "fake"
[models.shop]
profile = "trivial"
backend = "fake"
"""


def _settings(make: MakeSettings, prefix: str, tmp_path: Path, **kw: object) -> Settings:
    models = tmp_path / "models.toml"
    models.write_text(textwrap.dedent(MODELS))
    return make(broker_url=BROKER_URL, queue_prefix=prefix, worker_metrics_port=0, models_file=models, **kw)


def _requeued(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("gateway_queue_messages_total", {"event": "requeued"}) or 0.0


async def test_top_k_survives_a_move_and_a_requeue(gateway_factory: MakeSettings, prefix: str, tmp_path: Path) -> None:
    """Two jobs with ``top_k=2`` on shop's queue, taken by a worker that serves shop alone: one for
    photos (moved to ``<prefix>.work`` at once) and one for shop's version 9 (requeued to shop's
    queue for a worker that serves it). Both copies keep ``top_k=2``, and photos' worker then
    answers the moved one with 2 labels. Before, the worker read ``top_k`` only once the job's
    model was found to be served here, which is what fails on both paths: the copies said 5."""
    settings = _settings(gateway_factory, prefix, tmp_path)
    names = Names(prefix)
    shop = names.route("shop", "photos")
    moved, requeued = job(3, "moved"), job(4, "requeued")
    for message, header, value in ((moved, MODEL_HEADER, "photos"), (requeued, VERSION_HEADER, "9")):
        assert message.headers is not None
        message.headers.update({"top_k": 2, header: value})
    await publish(names, moved, requeued, route=shop)
    metrics = Metrics()
    stop = asyncio.Event()
    worker = asyncio.create_task(
        run_worker(settings.model_copy(update={"worker_models": "shop"}), stop, metrics=metrics)
    )
    try:
        async with asyncio.timeout(20):
            while await queue_depth(names.work) < 1 or _requeued(metrics) < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await worker
    (again,) = await drain(shop.queue)
    assert again.message_id == "requeued"
    assert again.headers is not None
    assert again.headers["top_k"] == 2
    assert int(again.headers[REQUEUES_HEADER]) >= 1  # type: ignore[arg-type]
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))  # photos, the default
    try:
        (result,) = await collect_results(names, 1, timeout=20)
    finally:
        stop.set()
        await worker
    assert result.job_id == "moved"
    assert result.status == "done"
    assert [label.index for label in result.labels][:1] == [3]
    assert len(result.labels) == 2


async def test_a_negative_requeue_count_is_no_way_around_the_cap(
    gateway_factory: MakeSettings, prefix: str, tmp_path: Path
) -> None:
    """A job for a version no worker serves with ``x-requeues: -3059``, beside one without the
    header: the forged one fails at once as ``bad_request`` naming ``x-requeues`` (dead-lettered),
    and the control goes round with its backoff (0.5 s, doubling), a few times in 3 s. Before, the
    negative count turned off both the backoff (its pause was 0.5 s / 2**3059) and the 20-requeue
    cap of a job no worker serves: it went round thousands of times a second, for ever."""
    settings = _settings(gateway_factory, prefix, tmp_path)
    names = Names(prefix)
    forged, control = job(3, "forged"), job(4, "control")
    for message in (forged, control):
        assert message.headers is not None
        message.headers[VERSION_HEADER] = "9"
    assert forged.headers is not None
    forged.headers[REQUEUES_HEADER] = -3059
    await publish(names, forged, control)
    metrics = Metrics()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, metrics=metrics))
    try:
        (result,) = await collect_results(names, 1, timeout=20)
        await asyncio.sleep(3)
    finally:
        stop.set()
        await worker
    assert result.job_id == "forged"
    assert result.error is not None
    assert result.error.error == "bad_request"
    assert "x-requeues" in result.error.detail
    assert 1 <= _requeued(metrics) <= 4  # the control's, with their backoff
    (dead,) = await drain(names.dead)
    assert dead.headers is not None
    assert dead.headers[ERROR_HEADER] == "bad_request"
