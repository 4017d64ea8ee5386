"""The shared GPU engine (``GATEWAY_TORCH_ENGINE=shared``): workers hand their batches to one
process through shared memory and a Unix socket, and its batcher merges them.

The wire and the merging are tested in one event loop with the fake backend (its answers name each
image, so a crossed answer shows); then a real ``gateway serve --workers 2`` with the torch backend
on the CPU and its engine process, against the same model called directly, and with the engine killed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry

from loadtests.harness.http_load import start_gateway, stop_process
from service.backends.engine import EngineClient, Geometry
from service.backends.engine_server import EngineServer
from service.backends.fake import FakeBackend
from service.backends.torch_backend import TorchBackend
from service.batching.batcher import DynamicBatcher
from service.errors import BackendError, BackendUnavailable, DeadlineExceeded, QueueFull
from service.images.preprocess import PreprocessConfig, prepare
from service.tune.runner import free_port
from tests.backends.engine_process import MODEL, engine_client, engine_process
from tests.backends.engine_process import images as process_images

pytestmark = pytest.mark.slow  # every test starts the shared engine as a process of its own

GEOMETRY = Geometry(image_size=8, classes=1000)


def images(*classes: int) -> list[np.ndarray]:
    """Tiny images whose fake-backend answer is ``classes`` (the first pixel's red value)."""
    out = []
    for c in classes:
        img = np.zeros((8, 8, 3), np.uint8)
        img[0, 0, 0] = c
        out.append(img)
    return out


@asynccontextmanager
async def engine(socket: Path, backend: FakeBackend, queue: int = 1000) -> AsyncIterator[EngineServer]:
    batcher = DynamicBatcher(
        backend.infer, max_batch_size=64, max_delay=0.0, max_queue_size=queue, max_inflight_batches=1
    )
    server = EngineServer(batcher, GEOMETRY, "fake engine", CollectorRegistry())
    batcher._on_batch = lambda report: server.observe(report.size)
    batcher.start()
    serving = asyncio.create_task(server.serve(server.listen(str(socket))))
    try:
        yield server
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await batcher.aclose()


@asynccontextmanager
async def worker(socket: Path) -> AsyncIterator[EngineClient]:
    client = EngineClient(str(socket), GEOMETRY, max_batch_size=4, slots=2)
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()


async def test_the_engine_merges_the_workers_batches_and_each_gets_its_own_answers(tmp_path: Path) -> None:
    socket = tmp_path / "engine.sock"
    fake = FakeBackend()
    async with engine(socket, fake), worker(socket) as one, worker(socket) as two:
        assert await one.ready() is None
        assert one.detail == "fake engine"
        fake.gate = asyncio.Event()  # the first batch waits, so the rest queue up behind it
        first = asyncio.create_task(one.infer(images(1)))
        await asyncio.sleep(0.05)
        calls = [one.infer(images(10, 11)), two.infer(images(20, 21, 22)), two.infer(images(30, 31, 32, 33))]
        tasks = [asyncio.create_task(call) for call in calls]
        await asyncio.sleep(0.1)
        fake.gate.set()
        answers = [await first, *await asyncio.gather(*tasks)]
        assert [list(a.argmax(axis=1)) for a in answers] == [[1], [10, 11], [20, 21, 22], [30, 31, 32, 33]]
        assert fake.batches == [1, 9]  # three batches from two workers ran as one
        assert all(a.dtype == np.float32 and a.shape[1] == 1000 for a in answers)


async def test_a_failed_engine_batch_fails_that_batch_only(tmp_path: Path) -> None:
    socket = tmp_path / "engine.sock"
    fake = FakeBackend()
    async with engine(socket, fake), worker(socket) as one:
        fake.fail_next = BackendError("the model fell over")
        with pytest.raises(BackendError, match="the model fell over"):
            await one.infer(images(5))
        assert list((await one.infer(images(6, 7))).argmax(axis=1)) == [6, 7]
        with pytest.raises(ValueError, match="over max_batch_size"):
            await one.infer(images(1, 2, 3, 4, 5))


async def test_a_full_engine_says_so_as_the_gateway_does(tmp_path: Path) -> None:
    """The engine's queue full is the worker's 429 (QueueFull), not a failed batch."""
    socket = tmp_path / "engine.sock"
    fake = FakeBackend()
    async with engine(socket, fake, queue=3), worker(socket) as one:
        fake.gate = asyncio.Event()
        running = asyncio.create_task(one.infer(images(1)))  # in the backend, held at the gate
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(one.infer(images(2, 3)))
        await asyncio.sleep(0.05)
        async with worker(socket) as two:
            with pytest.raises(QueueFull, match="queue is full"):
                await two.infer(images(4, 5))
        fake.gate.set()
        assert [list(a.argmax(axis=1)) for a in await asyncio.gather(running, queued)] == [[1], [2, 3]]


async def test_a_worker_without_its_engine_is_not_ready_and_reconnects(tmp_path: Path) -> None:
    socket = tmp_path / "engine.sock"
    async with worker(socket) as one:
        assert "not reachable" in (await one.ready() or "")
        with pytest.raises(BackendUnavailable):
            await one.infer(images(1))
        async with engine(socket, FakeBackend()):
            async with asyncio.timeout(5):
                while await one.ready() is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert list((await one.infer(images(3))).argmax(axis=1)) == [3]
        socket.unlink()
        async with asyncio.timeout(5):
            while await one.ready() is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)


SHARED_ENGINE = {
    "GATEWAY_BACKEND": "torch",
    "GATEWAY_TORCH_DEVICE": "cpu",
    "GATEWAY_TORCH_ENGINE": "shared",
    "GATEWAY_MODEL": "resnet50",
    "GATEWAY_WORKERS": "2",
    "GATEWAY_MAX_BATCH_SIZE": "4",
    "GATEWAY_REQUEST_TIMEOUT": "60",
}


def children(proc: subprocess.Popen[bytes], word: str) -> list[psutil.Process]:
    """``gateway serve``'s processes whose command line has ``word`` (``engine``, ``spawn_main``)."""
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):  # a killed one not reaped yet
            if any(word in a for a in child.cmdline()):
                found.append(child)
    return found


def poll(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.05)


def status(url: str) -> int:
    return httpx.get(url).status_code


@pytest.mark.slow
def test_serve_with_a_shared_engine_answers_as_the_model_does(
    tmp_path: Path, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    """Two workers, one engine process (the torch backend on the CPU): the scores are the model's,
    and the engine's batches are on every worker's /metrics. Each photo was decoded straight into
    the engine's memory and sent as it was: none copied."""
    proc, url = start_gateway([], tmp_path / "models", env=SHARED_ENGINE)
    try:
        ready = httpx.get(f"{url}/readyz").json()
        assert "engine shared by the workers" in ready["checks"]["runtime"]
        model = TorchBackend(None, device="cpu", max_batch_size=2)

        async def direct() -> np.ndarray:
            await model.start()
            try:
                return await model.infer([prepare(p, PreprocessConfig()) for p in (cat_jpeg, coffee_jpeg)])
            finally:
                await model.aclose()

        expected = asyncio.run(direct())
        for photo, scores in zip((cat_jpeg, coffee_jpeg), expected, strict=True):
            answer = httpx.post(f"{url}/classify?top_k=3", content=photo, headers={"content-type": "image/jpeg"})
            assert answer.status_code == 200, answer.text
            labels = answer.json()["results"][0]["labels"]
            assert [label["index"] for label in labels] == list(np.argsort(-scores)[:3])
            assert labels[0]["score"] == pytest.approx(float(scores.max()), abs=1e-4)
        metrics = httpx.get(f"{url}/metrics").text
        assert "gateway_engine_batch_size_count 2.0" in metrics
        assert 'gateway_engine_images_total{path="cell"} 2.0' in metrics
        assert 'gateway_engine_images_total{path="copied"} 0.0' in metrics
    finally:
        stop_process(proc)


def held_in_engine(pool: ThreadPoolExecutor, url: str, engine: psutil.Process, jpeg: bytes) -> Future[httpx.Response]:
    """A request to the gateway whose batch is in the engine, stopped (SIGSTOP) so that it stays there."""
    engine.send_signal(signal.SIGSTOP)
    request = pool.submit(
        httpx.post, f"{url}/classify", content=jpeg, headers={"content-type": "image/jpeg"}, timeout=90
    )
    poll(
        lambda: (
            'gateway_batcher_inflight_batches{model="resnet50",version="1"} 1.0' in httpx.get(f"{url}/metrics").text
        ),
        30,
        "the request's batch in the engine",
    )
    return request


@pytest.mark.slow
def test_serve_restarts_an_engine_killed_mid_request(tmp_path: Path, cat_jpeg: bytes) -> None:
    """The engine SIGKILLed with a request in it: the request fails at once with 503 (not at its
    60 s timeout, not never), ``gateway serve`` starts a new engine, the workers become ready again
    by themselves and requests are answered again."""
    proc, url = start_gateway([], tmp_path / "models", env=SHARED_ENGINE)
    try:
        (engine,) = children(proc, "engine")
        with ThreadPoolExecutor(1) as pool:
            request = held_in_engine(pool, url, engine, cat_jpeg)
            engine.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            answer = request.result(timeout=90)
        assert answer.status_code == 503, answer.text
        assert time.monotonic() - killed < 10  # at once: the request's own timeout is 60 s
        poll(lambda: [p.pid for p in children(proc, "engine")] not in ([], [engine.pid]), 30, "a new engine")
        (restarted,) = children(proc, "engine")
        poll(lambda: len(shared_memory_inodes(restarted.pid)) == 2, 120, "both workers connected to it")
        poll(lambda: status(f"{url}/readyz") == 200, 30, "ready again")
        for _ in range(4):  # whichever worker answers
            again = httpx.post(f"{url}/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
            assert again.status_code == 200, again.text
            assert status(f"{url}/healthz") == 200
    finally:
        stop_process(proc)


def shared_memory_inodes(pid: int) -> set[int]:
    """Inodes of the memory blocks a process maps to share with another (/dev/shm files, memfds)."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and (fields[5].startswith("/dev/shm/") or fields[5].startswith("/memfd:")):
            inodes.add(int(fields[4]))
    return inodes


def dev_shm_inodes() -> set[int]:
    return {entry.stat().st_ino for entry in Path("/dev/shm").iterdir()}


@pytest.mark.slow
def test_a_killed_workers_shared_memory_is_freed(tmp_path: Path, cat_jpeg: bytes) -> None:
    """A SIGKILLed worker (an OOM kill, uvicorn killing a hung worker) leaves no block behind: none
    in /dev/shm and none still mapped by the engine, so the kernel frees its memory; the worker
    uvicorn starts in its place is served."""
    proc, url = start_gateway([], tmp_path / "models", env=SHARED_ENGINE)
    try:
        (engine,) = children(proc, "engine")
        # the gateway answers once one worker is ready: wait until the engine maps both workers' blocks
        poll(lambda: len(shared_memory_inodes(engine.pid)) == 2, 120, "both workers connected to the engine")
        worker = children(proc, "spawn_main")[0]
        blocks = shared_memory_inodes(worker.pid)
        assert blocks & shared_memory_inodes(engine.pid)  # the worker's block, as the engine maps it
        worker.send_signal(signal.SIGKILL)
        poll(
            lambda: not blocks & (dev_shm_inodes() | shared_memory_inodes(engine.pid)),
            30,
            f"the killed worker's blocks {blocks} gone from /dev/shm and from the engine",
        )
        poll(lambda: len(children(proc, "spawn_main")) == 2, 60, "uvicorn's new worker")
        poll(lambda: status(f"{url}/readyz") == 200, 60, "the new worker ready")
        for _ in range(4):  # both workers answer
            answer = httpx.post(f"{url}/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
            assert answer.status_code == 200, answer.text
    finally:
        stop_process(proc)


@pytest.mark.slow
def test_no_engine_outlives_a_killed_gateway(tmp_path: Path) -> None:
    """``gateway serve`` SIGKILLed (an OOM kill): its engine, which no one would stop or restart,
    stops by itself (end-of-file on the pipe only the serving process held open)."""
    proc, _ = start_gateway([], tmp_path / "models", env=SHARED_ENGINE)
    workers = children(proc, "spawn_main")
    (engine,) = children(proc, "engine")
    proc.kill()
    proc.wait()
    for worker in workers:  # uvicorn's workers are not the engine's to stop
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    try:
        engine.wait(timeout=30)
    except psutil.TimeoutExpired:
        engine.kill()
        raise AssertionError("the engine outlived its gateway by 30 s") from None


@pytest.mark.slow
def test_a_request_in_the_engine_is_answered_when_every_process_of_the_gateway_is_terminated(
    tmp_path: Path, cat_jpeg: bytes
) -> None:
    """SIGTERM to every process of ``gateway serve`` at once (systemd's default stop, a Ctrl-C's
    SIGINT to the process group): the engine outlives the workers' drain, so a request already in
    it is answered 200; the engine stops after the workers, when serve lets go of its pipe."""
    proc, url = start_gateway([], tmp_path / "models", env=SHARED_ENGINE)
    try:
        (engine,) = children(proc, "engine")
        workers = children(proc, "spawn_main")
        with ThreadPoolExecutor(1) as pool:
            request = held_in_engine(pool, url, engine, cat_jpeg)
            for process in [psutil.Process(proc.pid), *workers, engine]:
                process.send_signal(signal.SIGTERM)
            engine.send_signal(signal.SIGCONT)
            answer = request.result(timeout=90)
        assert answer.status_code == 200, answer.text
        assert proc.wait(60) == 0
        engine.wait(30)
    finally:
        stop_process(proc)


@pytest.mark.slow
def test_serve_exits_non_zero_when_its_engine_cannot_start(tmp_path: Path) -> None:
    """An engine that exits at every start (here: a weights file that is not one): after
    GATEWAY_ENGINE_START_ATTEMPTS failed starts ``gateway serve`` stops its workers and exits
    non-zero, so that the container is restarted instead of staying up, unready, for ever."""
    weights = tmp_path / "weights.pth"
    weights.write_bytes(b"not a checkpoint")
    env = {
        **os.environ,
        **SHARED_ENGINE,
        "GATEWAY_MODEL_WEIGHTS": str(weights),
        "GATEWAY_ENGINE_START_ATTEMPTS": "2",
        "GATEWAY_MODELS_DIR": str(tmp_path / "models"),
        "GATEWAY_LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # its workers too, or they outlive the test
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert proc.returncode == 1, stderr.decode()[-2000:]
    assert b"the shared engine failed 2 starts in a row" in stderr


@pytest.mark.slow
def test_healthz_fails_while_the_engine_is_gone_too_long(tmp_path: Path, cat_jpeg: bytes) -> None:
    """A worker without its engine for GATEWAY_ENGINE_DOWN_LIMIT seconds fails /healthz (503, the
    gateway's error body), so an orchestrator restarts the pod; once an engine listens it is live,
    ready and answers again."""
    socket = tmp_path / "engine.sock"
    env = {
        **os.environ,
        **SHARED_ENGINE,
        "GATEWAY_MODEL": MODEL,
        "GATEWAY_WORKERS": "1",
        "GATEWAY_ENGINE_SOCKET": str(socket),  # an engine run on its own: no supervisor
        "GATEWAY_ENGINE_DOWN_LIMIT": "1",
        "GATEWAY_MODELS_DIR": str(tmp_path / "models"),
        "GATEWAY_LOG_LEVEL": "warning",
    }
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"

    def healthz() -> httpx.Response | None:
        try:
            return httpx.get(f"{url}/healthz")
        except httpx.TransportError:
            return None  # not listening yet

    try:
        poll(lambda: (r := healthz()) is not None and r.status_code == 503, 60, "/healthz failing")
        failing = httpx.get(f"{url}/healthz")
        assert failing.json()["error"] == "backend_unavailable"
        assert "no shared engine for" in failing.json()["detail"]
        with engine_process(socket):
            poll(lambda: status(f"{url}/readyz") == 200, 30, "ready with the engine")
            assert status(f"{url}/healthz") == 200
            answer = httpx.post(f"{url}/classify", content=cat_jpeg, headers={"content-type": "image/jpeg"})
            assert answer.status_code == 200, answer.text
    finally:
        stop_process(proc)


# --- a real engine process, stopped and killed under its worker ---------------------------------


async def test_calls_of_a_lost_engine_fail_at_once_and_leave_no_slot_taken(tmp_path: Path) -> None:
    """SIGKILL of the engine while one call is in it and another waits for the only slot: both fail
    with 503 at once (not at their timeout, not never), the slot is free again, and once an engine
    is back the worker's calls are answered (a call of the lost connection can never be)."""
    socket = tmp_path / "engine.sock"
    with engine_process(socket) as first_engine:
        async with engine_client(socket, slots=1) as client:
            assert list((await client.infer(process_images(3), timeout=60)).argmax(axis=1)) == [3]
            first_engine.send_signal(signal.SIGSTOP)  # the next call reaches it and stays there
            inside = asyncio.create_task(client.infer(process_images(1), timeout=60))
            waiting = asyncio.create_task(client.infer(process_images(2), timeout=60))
            connection = client._connection
            assert connection is not None
            async with asyncio.timeout(5):  # the first is in the engine, the second waits for its slot
                while not (connection.pending and client._slots._waiters):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            first_engine.kill()
            async with asyncio.timeout(5):  # well before the calls' own 60 s
                outcomes = await asyncio.gather(inside, waiting, return_exceptions=True)
            assert [type(outcome) for outcome in outcomes] == [BackendUnavailable, BackendUnavailable]
            with engine_process(socket):
                async with asyncio.timeout(10):
                    while await client.ready() is not None:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    answer = await client.infer(process_images(4, 5), timeout=60)
                assert list(answer.argmax(axis=1)) == [4, 5]


async def test_a_call_gives_up_at_its_timeout_while_the_engine_hangs(tmp_path: Path) -> None:
    """An engine that stops answering (SIGSTOP): the call fails with 504 at its timeout; its slot
    stays the engine's until the engine answers, then serves the next call."""
    socket = tmp_path / "engine.sock"
    with engine_process(socket) as process:
        async with engine_client(socket, slots=1) as client:
            process.send_signal(signal.SIGSTOP)
            async with asyncio.timeout(10):
                with pytest.raises(DeadlineExceeded):
                    await client.infer(process_images(1), timeout=0.3)
                with pytest.raises(DeadlineExceeded):  # the slot is still the stopped engine's
                    await client.infer(process_images(2), timeout=0.3)
                process.send_signal(signal.SIGCONT)
                assert list((await client.infer(process_images(3), timeout=30)).argmax(axis=1)) == [3]


async def test_a_stuck_engine_is_not_ready_then_not_live_and_recovers(tmp_path: Path) -> None:
    """An engine whose connection is up but which answers nothing (SIGSTOP: a deadlock, a hung
    GPU): once a call is ``answer_grace`` past its deadline unanswered, the worker is not ready
    (out of rotation), and after ``down_limit`` more not live (the pod is restarted). It used to
    stay ready and live for ever, every request a 504 at its deadline. Answers again: ready."""
    socket = tmp_path / "engine.sock"
    with engine_process(socket) as process:
        async with engine_client(socket, slots=1, answer_grace=0.3, down_limit=1.0) as client:
            assert await client.ready() is None
            process.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceeded):
                    await client.infer(process_images(1), timeout=0.2)
                assert await client.ready() is None  # within its grace
                assert client.liveness() is None
                await asyncio.sleep(0.5)
                assert "has not answered" in (await client.ready() or "")
                assert client.liveness() is None  # not for down_limit yet
                await asyncio.sleep(1.2)
                assert "has not answered" in (client.liveness() or "")
            finally:
                process.send_signal(signal.SIGCONT)
            async with asyncio.timeout(10):
                assert list((await client.infer(process_images(3), timeout=30)).argmax(axis=1)) == [3]
            assert await client.ready() is None
            assert client.liveness() is None


def _into_cells(client: EngineClient, *classes: int) -> list[np.ndarray]:
    """Images whose fake-backend answer is ``classes``, written into the client's cells as a
    decoder writes them."""
    out = []
    for image in process_images(*classes):
        cell = client.allocate_image()
        assert cell is not None
        cell[...] = image
        out.append(cell)
    return out


async def test_images_decoded_into_cells_reach_the_engine_without_a_copy(tmp_path: Path) -> None:
    """A batch whose images are all in the worker's cells is sent as their cell numbers: no slot,
    no copy, and each image gets its own answer. In a batch with images elsewhere only those are
    copied into a slot, and each image still gets its own answer."""
    socket = tmp_path / "engine.sock"
    with engine_process(socket):
        async with engine_client(socket, slots=1) as client:
            copies: list[tuple[int, int]] = []
            copy = client._copy

            async def counted(slot: int, images: list[np.ndarray]) -> None:
                copies.append((slot, len(images)))
                await copy(slot, images)

            client._copy = counted  # type: ignore[method-assign]
            sent: list[tuple[int, int]] = []
            client.on_sent = lambda in_cells, copied: sent.append((in_cells, copied))
            cells = _into_cells(client, 3, 5, 7)
            answers = await asyncio.gather(
                client.infer(cells[:2], timeout=30), client.infer(cells[2:], timeout=30)
            )  # two calls at once with one slot: neither waits for it
            assert [list(a.argmax(axis=1)) for a in answers] == [[3, 5], [7]]
            assert copies == []
            mixed = await client.infer([cells[0], *process_images(9), cells[2], *process_images(8)], timeout=30)
            assert list(mixed.argmax(axis=1)) == [3, 9, 7, 8]
            assert copies == [(0, 2)]  # the two images not in cells, into the slot; the others as they are
            assert sorted(sent) == [(1, 0), (2, 0), (2, 2)]


async def test_a_cell_stays_taken_until_the_engine_is_done_with_it(tmp_path: Path) -> None:
    """A call that gives up at its deadline while the engine still has it (SIGSTOP): its image's
    cell is not handed to another decoder, though the request dropped the image, until the engine
    answers; then it is free again. When every cell is taken a decoder gets none (and writes
    where it always did)."""
    socket = tmp_path / "engine.sock"
    with engine_process(socket) as process:
        async with engine_client(socket, slots=1, pool_images=1) as client:
            (cell,) = _into_cells(client, 4)
            assert client.allocate_image() is None
            process.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceeded):
                    await client.infer([cell], timeout=0.3)
                del cell
                gc.collect()
                assert client.allocate_image() is None  # the stopped engine may still read it
            finally:
                process.send_signal(signal.SIGCONT)
            async with asyncio.timeout(10):
                while (again := client.allocate_image()) is None:  # noqa: ASYNC110 (freed by the GC, no event)
                    await asyncio.sleep(0.05)
            again[...] = process_images(6)[0]
            assert list((await client.infer([again], timeout=30)).argmax(axis=1)) == [6]


@pytest.mark.parametrize("inflight", [1, 3])
async def test_the_engine_runs_its_own_number_of_batches_at_once(tmp_path: Path, inflight: int) -> None:
    """``GATEWAY_ENGINE_INFLIGHT_BATCHES``, not the workers' ``GATEWAY_MAX_INFLIGHT_BATCHES``:
    three workers' one-image calls (batches of one, each taking 0.5 s) end together with 3 batches
    at once, one after another with 1."""
    socket = tmp_path / "engine.sock"
    settings = {"GATEWAY_MAX_BATCH_SIZE": "1", "GATEWAY_FAKE_DELAY": "0.5", "GATEWAY_MAX_INFLIGHT_BATCHES": "1"}
    with engine_process(socket, GATEWAY_ENGINE_INFLIGHT_BATCHES=str(inflight), **settings):
        async with (
            engine_client(socket, slots=1) as a,
            engine_client(socket, slots=1) as b,
            engine_client(socket, slots=1) as c,
        ):
            started = time.perf_counter()
            answers = await asyncio.gather(*(w.infer(process_images(i), timeout=30) for i, w in enumerate((a, b, c))))
            took = time.perf_counter() - started
    assert [list(answer.argmax(axis=1)) for answer in answers] == [[0], [1], [2]]
    if inflight == 3:
        assert took < 1.0  # one round of 0.5 s
    else:
        assert took >= 1.45  # three rounds


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
async def test_the_engine_batches_by_the_gateways_policy(tmp_path: Path, policy: str) -> None:
    """``GATEWAY_BATCH_POLICY`` holds in the engine too. A call that arrives while one batch (0.5 s)
    runs and a second could: under ``fixed`` it waits for company until the backend is idle (within
    the 10 s ``max_delay``); under ``adaptive`` it goes at once (the engine batched ``fixed``
    whatever the setting, adding that wait to the workers' own)."""
    socket = tmp_path / "engine.sock"
    settings = {"GATEWAY_MAX_DELAY": "10", "GATEWAY_FAKE_DELAY": "0.5", "GATEWAY_ENGINE_INFLIGHT_BATCHES": "2"}
    with engine_process(socket, GATEWAY_BATCH_POLICY=policy, **settings):
        async with engine_client(socket, slots=1) as first, engine_client(socket, slots=1) as second:
            for value in (1, 2, 3):  # the adaptive policy's first batches teach it the backend's time
                running = asyncio.create_task(first.infer(process_images(value), timeout=30))
                await asyncio.sleep(0.05)  # in the backend now
                started = time.perf_counter()
                answer = await second.infer(process_images(value + 10), timeout=30)
                took = time.perf_counter() - started
                assert list(answer.argmax(axis=1)) == [value + 10]
                await running
    if policy == "fixed":
        assert took >= 0.85  # the rest of the first batch, then its own
    else:
        assert took < 0.8  # its own batch only
