"""Run a local ``tritonserver`` from a virtual environment holding PyPI's ``nvidia-pytriton`` wheel.

That wheel carries a real Triton (2.51) binary with the Python backend only, which serves the
``python`` repository variant on CPU hosts; it is what the tests and the benchmarks start.
``scripts/triton-venv`` creates such an environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class TritonNotInstalled(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    venv: Path
    root: Path
    """The pytriton package's ``tritonserver`` folder."""
    libdir: Path
    """The venv interpreter's LIBDIR: the Python stub must load this libpython, not the system's."""

    @classmethod
    def find(cls, venv: Path) -> TritonInstall:
        python = venv / "bin" / "python"
        if not python.exists():
            raise TritonNotInstalled(f"no Triton environment at {venv}; create it with scripts/triton-venv")
        out = subprocess.run(
            [
                str(python),
                "-c",
                "import os, sysconfig, pytriton; print(os.path.dirname(pytriton.__file__)); "
                "print(sysconfig.get_config_var('LIBDIR'))",
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise TritonNotInstalled(f"{venv} has no pytriton: {out.stderr.strip()}")
        package, libdir = out.stdout.split()
        root = Path(package) / "tritonserver"
        stub = root / "backends" / "python" / "triton_python_backend_stub"
        if not stub.exists():
            raise TritonNotInstalled(f"the Python backend stub is missing at {stub}; re-run scripts/triton-venv")
        return cls(venv, root, Path(libdir))

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.libdir), env.get("LD_LIBRARY_PATH")]))
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")])
        return env


@dataclass
class Ports:
    http: int
    grpc: int
    metrics: int


class LocalTriton:
    """One tritonserver process, on loopback ports unless ``address`` says otherwise.

    ``launcher`` is a command prefix that must exec the server in the same process (for instance
    ``ip netns exec NAME``, which the distributed benchmark uses to put Triton in its own network
    namespace), so that signals reach tritonserver itself."""

    def __init__(
        self,
        install: TritonInstall,
        repository: Path,
        ports: Ports,
        log: Path | None = None,
        *,
        address: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.install = install
        self.repository = repository
        self.ports = ports
        self.log = log
        self.address = address
        self.launcher = launcher
        self.extra_args = extra_args
        """More tritonserver flags (e.g. ``--trace-config`` for OpenTelemetry tracing)."""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"{self.address}:{self.ports.http}"

    def command(self) -> list[str]:
        return [
            *self.launcher,
            str(self.install.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.install.root / 'backends'}",
            f"--http-address={self.address}",
            f"--http-port={self.ports.http}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.address}",
            f"--metrics-port={self.ports.metrics}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            "--exit-on-error=true",
            *self.extra_args,
        ]

    def start(self, timeout: float = 60.0) -> None:
        out = self.log.open("ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command(), env=self.install.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.wait_ready(timeout)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with status {self.process.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"tritonserver not ready after {timeout} s; see {self.log}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> LocalTriton:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_venv() -> Path:
    """``GATEWAY_TRITON_VENV`` or ``.venv-triton`` in the current directory."""
    return Path(os.environ.get("GATEWAY_TRITON_VENV", ".venv-triton")).absolute()


if __name__ == "__main__":  # pragma: no cover - manual use: python -m service.triton.server REPO
    # Off Triton's defaults (8000-8002), which are the gateway's own HTTP and gRPC ports: both run on
    # one host (GATEWAY_TRITON_URL=127.0.0.1:8011).
    server = LocalTriton(TritonInstall.find(default_venv()), Path(sys.argv[1]).absolute(), Ports(8010, 8011, 8012))
    server.start()
    print(f"tritonserver ready: gRPC {server.grpc_url}, HTTP {server.http_url}")
    try:
        server.process.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        server.stop()
