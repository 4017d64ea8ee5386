"""One model's configuration in a Triton repository, changed in place and reloaded on a running
server: how ``gateway tune`` tries Triton's own settings (instance count, dynamic batching's queue
delay) without restarting Triton.

Triton re-reads a model's ``config.pbtxt`` on a load request only in explicit model-control mode
(``tritonserver --model-control-mode=explicit --load-model=NAME``); a load request for a model
already loaded reloads it, and Triton keeps serving the old version until the new one is ready.
The file is parsed and written with Triton's own ``ModelConfig`` protobuf schema, so any repository
works, not only the ones ``gateway models triton-repo`` writes; every other field stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import tritonclient.grpc
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from service.backends.triton_clients import client_module
from service.host.files import atomic_write

if TYPE_CHECKING:
    import tritonclient.http


class ReloadRefused(RuntimeError):
    """Triton would not (re)load the model: not in explicit model-control mode, or the new
    configuration failed to load."""


@dataclass(frozen=True)
class ServerSettings:
    instances: int
    """``count`` of the model's instance groups (per GPU for GPU groups)."""
    queue_delay_us: int
    """``dynamic_batching.max_queue_delay_microseconds``."""
    max_batch_size: int


@dataclass(frozen=True)
class TritonModel:
    repository: Path
    name: str
    url: str
    """host:port of Triton's gRPC port, or of its HTTP port with ``protocol="http"``."""
    protocol: Literal["grpc", "http"] = "grpc"

    @property
    def path(self) -> Path:
        return self.repository / self.name / "config.pbtxt"

    def read(self) -> mc.ModelConfig:
        if not self.path.is_file():
            raise FileNotFoundError(f"no {self.path}: is {self.repository} the repository Triton serves?")
        return text_format.Parse(self.path.read_text(), mc.ModelConfig())

    def settings(self) -> ServerSettings:
        config = self.read()
        counts = {group.count or 1 for group in config.instance_group} or {1}
        return ServerSettings(
            instances=max(counts),
            queue_delay_us=int(config.dynamic_batching.max_queue_delay_microseconds),
            max_batch_size=int(config.max_batch_size),
        )

    def check_tunable(self, *, delay: bool) -> None:
        """Refuse what cannot be tuned before any measuring starts."""
        config = self.read()
        if delay and not config.HasField("dynamic_batching"):
            raise ReloadRefused(
                f"model {self.name} has no dynamic_batching in {self.path}: Triton's queue delay cannot be tuned"
            )
        self.reload()

    def apply(self, instances: int | None, queue_delay_us: int | None) -> bool:
        """Write the settings given (None leaves one as it is) and reload the model if the file
        changed; True if it did."""
        config = self.read()
        before = config.SerializeToString(deterministic=True)
        if instances is not None:
            if not config.instance_group:
                config.instance_group.add()
            for group in config.instance_group:
                group.count = instances
        if queue_delay_us is not None:
            config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        if config.SerializeToString(deterministic=True) == before:
            return False
        note = "# instance_group count and max_queue_delay_microseconds set by gateway tune; the rest as it was\n"
        self.write(note + text_format.MessageToString(config))
        self.reload()
        return True

    def write(self, text: str) -> None:
        """Replace the file atomically: Triton may read it at any moment."""
        with atomic_write(self.path, "w") as out:  # readable by Triton's user, as the file it replaces
            out.write(text)

    def reload(self) -> None:
        client = self._client()
        try:
            client.load_model(self.name)
        except InferenceServerException as exc:
            message = exc.message() or str(exc)
            hint = (
                " (start tritonserver with --model-control-mode=explicit --load-model=" + self.name + ")"
                if "not allowed" in message or "polling" in message
                else ""
            )
            raise ReloadRefused(f"Triton at {self.url} did not load {self.name}: {message}{hint}") from exc
        finally:
            client.close()

    def _client(self) -> tritonclient.grpc.InferenceServerClient | tritonclient.http.InferenceServerClient:
        if self.protocol == "http":  # imported here: its gevent is needed by HTTP users only (the triton extra)
            client: tritonclient.http.InferenceServerClient = client_module("http").InferenceServerClient(self.url)
            return client
        return tritonclient.grpc.InferenceServerClient(self.url)
