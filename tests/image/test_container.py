"""The built image, run as a user runs it and checked from outside the container.

``scripts/image-test`` builds the image and runs this module with ``GATEWAY_TEST_IMAGE`` naming it
(the whole suite leaves this folder out without that variable). The gateway and the worker are
started with docker-compose.host.yml, as a developer runs the stack against the host's services:
on the host's network (the engine here has no bridge), locked down as production runs them (a
read-only root with a tmpfs for /tmp, every capability dropped, no new privileges), the worker on
the host's RabbitMQ under a queue prefix of this run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from service.settings import Settings
from service.triton.server import LocalTriton
from service.tune.runner import free_port
from tests.conftest import CAT_CLASSES
from tests.jobs.conftest import BROKER_URL, _delete_everything
from tests.test_deploy import ROOT

IMAGE = os.environ.get("GATEWAY_TEST_IMAGE", "")
LOCKED_DOWN = ("--read-only", "--tmpfs=/tmp:rw,size=256m", "--cap-drop=ALL", "--security-opt=no-new-privileges")
GRACE = 30  # seconds: docker compose's stop_grace_period and the Kubernetes default


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Container:
    name: str
    url: str

    def inspect(self, template: str) -> str:
        return docker("inspect", "--format", template, self.name)

    def logs(self) -> str:
        done = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True, timeout=30)
        return done.stdout + done.stderr


def start(name: str, port: int, *command: str, env: dict[str, str] | None = None) -> Container:
    """A container on the host's network, its gRPC port (the image's 8001 otherwise) a free one."""
    env = {"GATEWAY_GRPC_PORT": str(free_port()), **(env or {})}
    environment = [f"--env={key}={value}" for key, value in env.items()]
    docker("run", "--detach", "--name", name, "--network", "host", *LOCKED_DOWN, *environment, IMAGE, *command)
    return Container(name, f"http://127.0.0.1:{port}")


class HostStack:
    """docker-compose.host.yml under a project name of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.project = f"imagetest{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, "GATEWAY_IMAGE": IMAGE, **env}

    def compose(self, *args: str) -> str:
        command = ["docker-compose", "-f", str(ROOT / "docker-compose.host.yml"), "-p", self.project, *args]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip()

    def up(self, service: str, port: int) -> Container:
        self.compose("up", "--detach", "--no-build", service)
        return Container(self.compose("ps", "--quiet", service), f"http://127.0.0.1:{port}")

    def down(self) -> None:
        self.compose("down", "--timeout", "30")


def remove(container: Container) -> None:
    docker("rm", "--force", container.name, check=False)


def wait_ready(container: Container, path: str = "/readyz", timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if container.inspect("{{.State.Running}}") != "true":
            raise AssertionError(f"{container.name} exited:\n{container.logs()[-4000:]}")
        try:
            if httpx.get(container.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{container.name} not ready on {path} after {timeout} s:\n{container.logs()[-4000:]}")


def top_label(payload: dict[str, Any]) -> tuple[int, str]:
    """The best label of an answer: of /classify's first result, or of a job's status."""
    labels = payload["results"][0]["labels"] if "results" in payload else payload["labels"]
    return int(labels[0]["index"]), str(labels[0]["label"])


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    name = f"imagetest-{uuid.uuid4().hex[:8]}"
    yield name
    asyncio.run(_delete_everything(name))


@pytest.fixture(scope="module")
def stack(prefix: str) -> Iterator[HostStack]:
    ports = {
        "GATEWAY_PORT": str(free_port()),
        "GATEWAY_GRPC_PORT": str(free_port()),
        "GATEWAY_WORKER_METRICS_PORT": str(free_port()),
    }
    stack = HostStack({"GATEWAY_BROKER_URL": BROKER_URL, "GATEWAY_QUEUE_PREFIX": prefix, **ports})
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="module")
def gateway(stack: HostStack) -> Container:
    """``serve`` on the embedded default, with the broker set so that it also takes offline jobs."""
    container = stack.up("gateway", int(stack.env["GATEWAY_PORT"]))
    wait_ready(container)
    return container


def test_the_image_runs_as_a_non_root_user() -> None:
    user = docker("image", "inspect", "--format", "{{.Config.User}}", IMAGE)
    assert user not in ("", "0", "root"), f"the image's user is {user!r}"


def test_the_runtime_image_carries_no_build_or_test_tools() -> None:
    """Multi-stage: no pip, no model tooling (NNCF), no PyTorch, no test tools, no compiler. (onnx is
    there: a declared model's file is read and wrapped where it is served.)"""
    probe = "import importlib.util as u; print(' '.join(m for m in MODULES if u.find_spec(m)))".replace(
        "MODULES", repr(("pip", "setuptools", "nncf", "torch", "pytest", "hypothesis"))
    )
    found = docker("run", "--rm", "--network", "none", *LOCKED_DOWN, "--entrypoint", "python", IMAGE, "-c", probe)
    assert found == "", f"the runtime image has {found}"
    shell = ("run", "--rm", "--network", "none", "--entrypoint", "sh", IMAGE, "-c")
    compilers = docker(*shell, "command -v gcc cc c++ make || true")
    assert compilers == "", compilers


def test_serve_answers_its_probes(gateway: Container) -> None:
    health = httpx.get(gateway.url + "/healthz", timeout=5)
    assert health.status_code == 200
    ready = httpx.get(gateway.url + "/readyz", timeout=5)
    assert ready.status_code == 200
    checks = ready.json()["checks"]
    assert checks["backend"].endswith("ok"), checks  # "embedded: ok"
    deadline = time.monotonic() + 15  # the broker connects in the background: online mode does not wait for it
    while checks["broker"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
        checks = httpx.get(gateway.url + "/readyz", timeout=5).json()["checks"]
    assert checks["broker"] == "ok", checks


def test_a_real_photo_gets_its_label(gateway: Container, cat_jpeg: bytes) -> None:
    response = httpx.post(gateway.url + "/classify", files={"file": ("cat.jpg", cat_jpeg, "image/jpeg")}, timeout=30)
    assert response.status_code == 200, response.text
    index, label = top_label(response.json())
    assert index in CAT_CLASSES, f"the cat photo was labelled {label!r}"


def test_a_real_photo_gets_its_label_over_grpc(gateway: Container, stack: HostStack, cat_jpeg: bytes) -> None:
    """The Open Inference Protocol over gRPC on the container's GATEWAY_GRPC_PORT, as Triton's own
    client calls it: the photo's bytes as IMAGE, the best labels asked for as a classification."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.env['GATEWAY_GRPC_PORT']}")
    try:
        image = grpcclient.InferInput("IMAGE", [1], "BYTES")
        image.set_data_from_numpy(np.array([cat_jpeg], dtype=np.object_))
        wanted = [grpcclient.InferRequestedOutput("PROBABILITIES", class_count=3)]
        result = client.infer(Settings.model_fields["model"].default, [image], outputs=wanted, client_timeout=30)
    finally:
        client.close()
    best = result.as_numpy("PROBABILITIES")[0][0].decode()  # "score:index:label"
    _, index, label = best.split(":", 2)
    assert int(index) in CAT_CLASSES, f"the cat photo was labelled {label!r} over gRPC"


def test_metrics_count_what_was_served(gateway: Container, cat_jpeg: bytes) -> None:
    def images_classified() -> float:
        text = httpx.get(gateway.url + "/metrics", timeout=5).text
        count = re.search(r'^gateway_images_classified_total\{mode="online",[^}]*\} (\S+)$', text, re.M)
        return float(count.group(1)) if count else 0.0

    before = images_classified()
    response = httpx.post(gateway.url + "/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
    assert response.status_code == 200, response.text
    assert images_classified() == before + 1


def test_the_docker_healthcheck_turns_healthy(gateway: Container) -> None:
    deadline = time.monotonic() + 90  # start period 60 s, interval 10 s
    while (status := gateway.inspect("{{.State.Health.Status}}")) != "healthy":
        assert status in ("starting", "healthy"), f"health: {status}; {gateway.inspect('{{json .State.Health}}')}"
        assert time.monotonic() < deadline, "the healthcheck did not turn healthy in 90 s"
        time.sleep(1)


def test_it_runs_without_root_privileges_or_a_writable_root(gateway: Container) -> None:
    status = docker("exec", gateway.name, "cat", "/proc/1/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] != "0", fields["Uid"]
    assert fields["Gid"].split()[0] != "0", fields["Gid"]
    for caps in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[caps], 16) == 0, f"{caps} = {fields[caps]}"
    assert fields["NoNewPrivs"].strip() == "1"
    assert gateway.inspect("{{.HostConfig.ReadonlyRootfs}}") == "true"
    wrote = subprocess.run(
        ["docker", "exec", gateway.name, "sh", "-c", "echo x > /opt/models/x"], capture_output=True, text=True
    )
    assert wrote.returncode != 0
    assert "Read-only file system" in wrote.stderr


def test_an_offline_job_is_classified_by_the_worker_container(
    gateway: Container, stack: HostStack, cat_jpeg: bytes
) -> None:
    submitted = httpx.post(
        gateway.url + "/classify?mode=offline", files={"file": ("cat.jpg", cat_jpeg, "image/jpeg")}, timeout=30
    )
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()["jobs"][0]
    status_url = gateway.url + job["status_url"]
    time.sleep(2)  # no worker yet: the job waits in the queue
    assert httpx.get(status_url, timeout=5).json()["status"] == "pending"

    worker = stack.up("worker", int(stack.env["GATEWAY_WORKER_METRICS_PORT"]))
    try:
        deadline = time.monotonic() + 120
        while (answer := httpx.get(status_url, timeout=5).json())["status"] == "pending":
            assert worker.inspect("{{.State.Running}}") == "true", worker.logs()[-4000:]
            assert time.monotonic() < deadline, f"the job is still pending:\n{worker.logs()[-4000:]}"
            time.sleep(0.5)
        assert answer["status"] == "done", json.dumps(answer)
        index, label = top_label(answer)
        assert index in CAT_CLASSES, f"the worker labelled the cat {label!r}"
        worker_metrics = httpx.get(worker.url + "/metrics", timeout=5).text
        offline = re.search(r'^gateway_images_classified_total\{mode="offline",[^}]*\} (\S+)$', worker_metrics, re.M)
        assert offline, worker_metrics[:2000]
        assert float(offline.group(1)) == 1  # this worker classified it
    finally:
        stack.compose("stop", "worker")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_serve_classifies_through_a_triton_on_the_host(triton: LocalTriton, protocol: str, cat_jpeg: bytes) -> None:
    """The backend compose and Kubernetes run: tritonclient from the lean environment, a real Triton."""
    port = free_port()
    env = {
        "GATEWAY_PORT": str(port),
        "GATEWAY_BACKEND": "triton",
        "GATEWAY_TRITON_PROTOCOL": protocol,
        "GATEWAY_TRITON_URL": triton.grpc_url if protocol == "grpc" else triton.http_url,
    }
    container = start(f"triton-image-test-{uuid.uuid4().hex[:8]}", port, "serve", env=env)
    try:
        wait_ready(container)
        response = httpx.post(container.url + "/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
        assert response.status_code == 200, response.text
        index, label = top_label(response.json())
        assert index in CAT_CLASSES, f"the cat photo was labelled {label!r} through Triton"
    finally:
        remove(container)


def test_sigterm_under_load_answers_every_request_then_exits_0(cat_jpeg: bytes) -> None:
    port = free_port()
    # Small batches one at a time, so that a burst is still queued when the signal comes.
    env = {"GATEWAY_PORT": str(port), "GATEWAY_MAX_BATCH_SIZE": "2", "GATEWAY_MAX_INFLIGHT_BATCHES": "1"}
    container = start(f"drain-image-test-{uuid.uuid4().hex[:8]}", port, "serve", env=env)
    try:
        wait_ready(container)
        outcome = asyncio.run(_terminate_under_load(container, cat_jpeg, requests=48))
        statuses, labels, seconds_to_exit = outcome
        assert statuses == [200] * 48, statuses
        assert all(index in CAT_CLASSES for index in labels), labels
        assert container.inspect("{{.State.ExitCode}}") == "0", container.logs()[-4000:]
        assert container.inspect("{{.State.OOMKilled}}") == "false"
        assert seconds_to_exit < GRACE
    finally:
        remove(container)


async def _terminate_under_load(
    container: Container, photo: bytes, requests: int
) -> tuple[list[int], list[int], float]:
    """Send ``requests`` photos at once, wait until the gateway reports most of them queued, send
    SIGTERM, and collect every answer; then wait for the container to exit."""
    limits = httpx.Limits(max_connections=requests)
    async with httpx.AsyncClient(base_url=container.url, timeout=60, limits=limits) as client:

        async def classify() -> tuple[int, int]:
            response = await client.post("/classify", content=photo, headers={"content-type": "image/jpeg"})
            return response.status_code, top_label(response.json())[0] if response.status_code == 200 else -1

        async def queued() -> float:
            text = (await client.get("/metrics")).text
            match = re.search(r"^gateway_batcher_queue_depth\{[^}]*\} (\S+)$", text, re.M)
            return float(match.group(1)) if match else 0.0

        tasks = [asyncio.create_task(classify()) for _ in range(requests)]
        async with asyncio.timeout(30):
            while await queued() < requests // 4:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        docker("kill", "--signal", "TERM", container.name)
        signalled = time.monotonic()
        answers = await asyncio.gather(*tasks)
    await asyncio.to_thread(docker, "wait", container.name, timeout=GRACE + 10)
    return [status for status, _ in answers], [index for _, index in answers], time.monotonic() - signalled
