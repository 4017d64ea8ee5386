"""No answer, info-level log line or metric label names an internal identifier a client could use
(Triton's 2025 advisory: an error text revealed a shared-memory key an attacker then registered).
Real gateways are driven into each failure (Triton killed, a shared-memory region Triton refuses, a
model file that does not load, the broker down or its queue gone, the shared engine gone) and every
surface a client reads is searched for the deployment's addresses, paths, queue and region names.
The details go to the log at warning, for the operator."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm

from service.backends.base import Images
from service.backends.fake import FakeBackend
from service.errors import BackendError, BackendUnavailable
from service.models.profiles import get_profile
from service.models.store import model_path
from service.settings import Settings
from service.triton.server import LocalTriton, TritonInstall
from service.tune.runner import free_port
from tests.backends.test_engine import engine, images, worker
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, _delete_everything, broker_ok
from tests.triton_server import start_triton

MakeSettings = Callable[..., Settings]
MODEL = "efficientnet-lite0"
PNG = png_bytes(solid_image(9, 32))
V2 = json.dumps(
    {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(PNG).decode()]}]}
)


async def _surfaces(client: httpx.AsyncClient, *, offline: bool = False) -> dict[str, str]:
    """Every answer a client can get from the gateway now (keys are off: it sees every detail)."""
    png = {"content-type": "image/png"}
    answers = {
        "classify": await client.post("/classify", content=PNG, headers=png),
        "v2 infer": await client.post(f"/v2/models/{MODEL}/infer", content=V2),
    }
    if offline:
        answers["offline submit"] = await client.post("/classify", params={"mode": "offline"}, content=PNG, headers=png)
        answers["job"] = await client.get("/jobs/0123456789abcdef0123456789abcdef")
    for path in (
        "/readyz",
        "/healthz",
        "/v2/health/ready",
        f"/v2/models/{MODEL}",
        f"/v2/models/{MODEL}/ready",
        "/v1/models",
        f"/v1/models/{MODEL}",
        "/metrics",
    ):
        answers[path] = await client.get(path)
    return {name: f"{answer.status_code} {answer.headers} {answer.text}" for name, answer in answers.items()}


def _assert_clean(
    texts: dict[str, str],
    forbidden: Iterable[str],
    caplog: pytest.LogCaptureFixture,
    in_logs: Iterable[str] | None = None,
) -> None:
    """No text holds a forbidden substring, and no log record at INFO holds one of ``in_logs`` (by
    default the same; debug lines may name what an operator debugging needs)."""
    forbidden = [f for f in forbidden if f]
    for name, text in texts.items():
        for word in forbidden:
            assert word not in text, f"{name} names {word!r}: {text[:2000]}"
    logged = forbidden if in_logs is None else list(in_logs)
    for record in caplog.records:  # the gateway's own lines (libraries' are held at warning: test_logs)
        if record.levelno == logging.INFO and record.name.startswith(("service", "uvicorn")):
            message = record.getMessage()
            assert not any(word in message for word in logged), f"an info line: {message}"


def _triton_words(server: LocalTriton, repository: Path) -> list[str]:
    return [
        f"127.0.0.1:{server.ports.grpc}",
        f"127.0.0.1:{server.ports.http}",
        f":{server.ports.grpc}",
        f":{server.ports.http}",
        str(repository),
        "/dev/shm",
        "gateway-",  # the shared-memory regions' prefix (their names and keys)
    ]


@pytest.mark.triton
async def test_triton_killed_leaves_no_address_or_region_in_any_answer(
    gateway_factory: MakeSettings,
    triton_install: TritonInstall,
    triton_repository: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Triton (gRPC, shared memory) dies under a serving gateway: the 503s, /readyz, the health
    and model routes and /metrics say Triton is unreachable without its host, port, repository or
    the regions' names (they said "Triton at 127.0.0.1:PORT is unreachable: <the client's error>")."""
    caplog.set_level(logging.INFO)
    server = start_triton(triton_install, triton_repository, tmp_path)
    settings = gateway_factory(
        backend="triton", triton_url=server.grpc_url, triton_shared_memory=True, readiness_interval=0.2
    )
    try:
        async with running_gateway(settings) as client:
            assert (
                await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
            ).status_code == 200
            server.kill()
            async with asyncio.timeout(10):
                while (await client.get("/readyz")).status_code != 503:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            texts = await _surfaces(client)
    finally:
        server.stop()
    assert texts["classify"].startswith("503")
    assert "unreachable" in texts["/readyz"]
    _assert_clean(texts, [*_triton_words(server, triton_repository), str(settings.models_dir)], caplog)
    assert any(r.levelno == logging.WARNING and server.grpc_url in r.getMessage() for r in caplog.records)


@pytest.mark.triton
async def test_a_region_triton_refuses_is_not_named_to_the_client(
    gateway_factory: MakeSettings,
    triton_install: TritonInstall,
    triton_repository: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shared-memory failure: the names of the gateway's next regions (its pair, and the pair
    that replaces it when a call fails) are taken in Triton by another, smaller region, so the
    batch fails in Triton, twice, with a message naming the region. The client's 5xx says the
    batch failed, not which region (an attacker who learns the name can register it first, as in
    Triton's advisory); the next request is served on a third pair."""
    caplog.set_level(logging.INFO)
    server = start_triton(triton_install, triton_repository, tmp_path)
    settings = gateway_factory(
        backend="triton", triton_url=server.grpc_url, triton_shared_memory=True, max_inflight_batches=1
    )
    keys = [f"/squatter-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    squatters = [shm.create_shared_memory_region(key[1:], key, 64) for key in keys]
    admin = triton_http.InferenceServerClient(server.http_url)
    try:
        async with running_gateway(settings) as client:
            assert (await client.get("/healthz")).status_code == 200  # (answered once the lifespan is done)
            pool = client.app.state.gateway.models.default.versions["1"].running.backend.inner._shm
            taken = [f"{pool._prefix}-{serial}-in" for serial in (1, 2)]  # the pair, and the one replacing it
            for name, key in zip(taken, keys, strict=True):
                admin.register_system_shared_memory(name, key, 64)
            refused = await client.post("/classify", content=PNG, headers={"content-type": "image/png"})
            texts = await _surfaces(client)
    finally:
        admin.unregister_system_shared_memory()
        admin.close()
        for squatter in squatters:
            shm.destroy_shared_memory_region(squatter)
        server.stop()
    assert refused.status_code >= 500, refused.text
    assert texts["classify"].startswith("200")  # a new pair, under new names
    _assert_clean({"refused": refused.text, **texts}, [*_triton_words(server, triton_repository), *taken], caplog)


async def test_a_model_that_does_not_load_names_no_path(
    models_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The embedded backend's model file is not a model (a disk's bad copy): /readyz, the 503s and
    the model routes say it failed to load, without its path (they quoted ONNX Runtime's message,
    which names the file); the log says where, at warning or above."""
    caplog.set_level(logging.INFO)
    mine = tmp_path / "models"
    shutil.copytree(models_dir, mine)
    path = model_path(mine, get_profile(MODEL))
    path.write_bytes(b"not an ONNX graph")
    async with running_gateway(Settings(models_dir=mine)) as client:  # type: ignore[call-arg]
        texts = await _surfaces(client)
    assert texts["classify"].startswith("503")
    assert "failed to load" in texts["/readyz"]
    _assert_clean(texts, [str(mine), path.name, str(tmp_path)], caplog)
    assert any(r.levelno >= logging.WARNING and str(path) in r.getMessage() + str(r.exc_text) for r in caplog.records)


@pytest.mark.rabbitmq
async def test_the_broker_down_names_no_address(
    gateway_factory: MakeSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """No broker at its address: the offline submit's 503 and /readyz say the broker is not
    connected, without its URL, host, port, user or the queue prefix (they showed the redacted URL)."""
    caplog.set_level(logging.INFO)
    closed, prefix = free_port(), f"leak-{uuid.uuid4().hex[:8]}"
    settings = gateway_factory(
        broker_url=f"amqp://tenant:secret@127.0.0.1:{closed}/", queue_prefix=prefix, backend="fake"
    )
    async with running_gateway(settings, FakeBackend()) as client:
        texts = await _surfaces(client, offline=True)
    assert texts["offline submit"].startswith("503")
    assert "not connected" in texts["/readyz"]
    _assert_clean(texts, [f"127.0.0.1:{closed}", f":{closed}", "amqp", "tenant", "secret", prefix], caplog)


@pytest.mark.rabbitmq
async def test_a_queue_gone_names_no_queue(gateway_factory: MakeSettings, caplog: pytest.LogCaptureFixture) -> None:
    """The model's work queue is deleted under a connected gateway (an operator's mistake, a
    policy): the submit's 503 says the message could not be routed to its queue, without the
    queue's name (it was quoted: the prefix and the model, the names of other tenants' queues)."""
    caplog.set_level(logging.INFO)
    prefix = f"leak-{uuid.uuid4().hex[:8]}"
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, backend="fake")
    try:
        async with running_gateway(settings, FakeBackend()) as client:
            await broker_ok(client)
            queues = await asyncio.to_thread(_rabbitmqctl, "list_queues", "-q", "name")
            for queue in queues.split():
                if queue.startswith(f"{prefix}.work"):
                    await asyncio.to_thread(_rabbitmqctl, "delete_queue", queue)
            texts = await _surfaces(client, offline=True)
    finally:
        await _delete_everything(prefix)
    assert texts["offline submit"].startswith("503"), texts["offline submit"]
    _assert_clean(
        texts, [prefix, BROKER_URL.split("@")[-1].rstrip("/")], caplog, in_logs=[prefix, BROKER_URL.split("@")[-1]]
    )


def _rabbitmqctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow  # it starts the shared engine as a process of its own
async def test_the_shared_engine_gone_or_failing_names_no_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose shared engine is not there says so without the engine socket's path; an
    engine whose backend fails with an error naming a file answers the worker with the failure's
    kind, not the file (the text crossed from the engine's process into the workers' answers)."""
    caplog.set_level(logging.INFO)
    socket = tmp_path / "engine.sock"
    async with worker(socket) as lonely:
        problem = await lonely.ready() or ""
        with pytest.raises(BackendUnavailable) as refused:
            await lonely.infer(images(1))
    assert "not reachable" in problem
    secret = tmp_path / "models" / "secret.onnx"

    class Failing(FakeBackend):
        async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
            raise FileNotFoundError(2, "No such file or directory", str(secret))

    async with engine(socket, Failing()), worker(socket) as one:
        with pytest.raises(BackendError) as failed:
            await one.infer(images(1))
    _assert_clean(
        {"ready": problem, "refused": refused.value.detail, "failed": failed.value.detail}, [str(tmp_path)], caplog
    )
    assert "FileNotFoundError" in failed.value.detail
