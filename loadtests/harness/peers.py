"""Peer servers the gateway is compared with: the same job (one JPEG posted as multipart ``file``,
OpenCV decode, centre crop to 224 px, the same ONNX file on ONNX Runtime, JSON top 5) written the
way LitServe and BentoML each would, with their own dynamic batching (``loadtests/peers/``).

Each peer runs in a virtual environment of its own (``.venv-peers/<name>``, made by ``ensure_env``)
without this project installed: it gets the model file and a labels file (``labels_file``) through
its environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtests.harness.http_load import stop_process
from loadtests.harness.photos import sample_photos
from loadtests.harness.resources import pinned
from service.models.profiles import get_profile
from service.tune.runner import free_port

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venv-peers"

PEERS = ("litserve", "bentoml")

# The libraries both peers share, at the versions the gateway's own environment runs (decoding and
# inference then cost the same in all three servers; only the serving framework differs).
_COMMON = ("onnxruntime==1.32.0", "opencv-python-headless==5.0.0.93", "numpy==2.4.6")
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    # python-multipart: FastAPI (under LitServe) parses multipart forms with it
    "litserve": ("litserve==0.2.19", "python-multipart==0.0.34", *_COMMON),
    "bentoml": ("bentoml==1.4.40", *_COMMON),
}

BATCH = 16
"""Most images in one ONNX Runtime call: the gateway's ``max_batch_size`` default."""
MAX_WAIT_S = 0.005
"""Longest a batch waits to fill: the gateway's ``max_delay`` default."""
TIMEOUT_S = 10.0
"""How long a request may wait for its answer: the gateway's ``request_timeout`` default."""
READY_TIMEOUT_S = 180.0


def _stamp(name: str) -> str:
    """What an environment was installed from: its pins and the interpreter that made it."""
    lines = [f"python {sys.version_info.major}.{sys.version_info.minor}", *sorted(REQUIREMENTS[name])]
    return "\n".join(lines) + "\n"


def ensure_env(name: str) -> Path:
    """The python of ``.venv-peers/<name>``, made with ``python -m venv`` and the peer's pinned
    requirements installed, unless it was made already from the same pins (a stamp file in the
    environment records them: a change of pins installs again)."""
    if name not in REQUIREMENTS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    venv = VENVS / name
    python = venv / "bin" / "python"
    stamp = venv / "peer-requirements.txt"
    wanted = _stamp(name)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    stamp.unlink(missing_ok=True)  # an interrupted install is not taken for a finished one
    subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *REQUIREMENTS[name]],
        check=True,
    )
    stamp.write_text(wanted)
    return python


def labels_file(folder: Path) -> Path:
    """The 1,000 ImageNet labels of the built-in profiles, one a line, in output order."""
    path = folder / "imagenet-labels.txt"
    path.write_text("".join(f"{label}\n" for label in get_profile("efficientnet-lite0").labels))
    return path


def threads_for(cpus: Collection[int] | None) -> int:
    """ONNX Runtime intra-op threads of a peer: every CPU it may run on (it runs one batch at a time)."""
    return len(cpus) if cpus is not None else len(os.sched_getaffinity(0))


def _command(name: str, python: Path, port: int) -> list[str]:
    if name == "litserve":
        return [str(python), "-m", "loadtests.peers.litserve_server", "--host", "127.0.0.1", "--port", str(port)]
    # `bentoml serve` is the framework's way to run a service
    service = "loadtests.peers.bentoml_service:Classifier"
    return [str(python), "-m", "bentoml", "serve", service, "--working-dir", str(ROOT), "--port", str(port)]


CLASSIFY_PATH = "/classify"
"""Both peers' route, as the gateway's."""


def _wait_answers(proc: subprocess.Popen[bytes], url: str, photo: bytes, timeout: float, what: str) -> None:
    """Return once ``url`` answers a real photo with 200: the model is loaded and the batcher runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        try:
            answer = httpx.post(url, files={"file": ("photo.jpg", photo, "image/jpeg")}, timeout=10)
            if answer.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} did not answer a photo within {timeout:.0f} s")


@contextmanager
def peer(name: str, model: Path, labels: Path, cpus: Collection[int] | None = None) -> Iterator[tuple[int, str]]:
    """(pid, URL of its classify route) of a peer server once it has answered a photo; stopped on
    exit (SIGTERM, on which each framework stops its workers; SIGKILL to what is left after 30 s).

    The pid is the process started here, and neither framework serves in that one process alone:
    LitServe's main process starts a multiprocessing manager (its request queue), an API server
    (uvicorn, which parses the form) and an inference worker (decoding, batching, ONNX Runtime);
    ``bentoml serve`` is a supervisor whose one worker process does everything. So a benchmark
    counting their CPU time or memory must count this process and all its descendants
    (``loadtests.harness.resources.children``). ``cpus`` pins all of them. Each peer runs one
    inference worker, one batch at a time, on ``threads_for(cpus)`` ONNX Runtime threads: the same
    policy in both. What the server prints goes to ``.venv-peers/<name>/server.log``."""
    python = ensure_env(name)
    port = free_port()
    env = {
        **os.environ,
        "PEER_MODEL": str(model),
        "PEER_LABELS": str(labels),
        "PEER_THREADS": str(threads_for(cpus)),
        "PEER_MAX_BATCH": str(BATCH),
        "PEER_MAX_WAIT_S": str(MAX_WAIT_S),
        "PEER_TIMEOUT_S": str(TIMEOUT_S),
        "PYTHONPATH": str(ROOT),  # loadtests.peers only: the project itself is not installed there
        "BENTOML_HOME": str(VENVS / name / "bentoml-home"),  # not ~/bentoml
        "BENTOML_DO_NOT_TRACK": "True",
    }
    env.pop("VIRTUAL_ENV", None)
    log = (VENVS / name / "server.log").open("ab")  # its own log: at overload a peer logs a traceback per request
    proc = subprocess.Popen(
        _command(name, python, port),
        env=env,
        cwd=ROOT,
        preexec_fn=pinned(cpus),
        start_new_session=True,  # a process group of its own: what is left of it can be killed at once
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()  # the child holds it
    try:
        url = f"http://127.0.0.1:{port}{CLASSIFY_PATH}"
        _wait_answers(proc, url, sample_photos()[0][1], READY_TIMEOUT_S, f"{name} peer")
        yield proc.pid, url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the peer's main process (each framework stops its own workers on it), SIGKILL after
    30 s; then SIGKILL to anything of its process group still left."""
    stop_process(proc, timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
