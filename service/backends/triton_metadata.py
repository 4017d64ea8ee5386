"""What the user's Triton says about a model, asked synchronously where the models' catalog is
read (at start, before any event loop): its metadata and config, and its labels.

Short timeouts on every call, and a bounded wait for a Triton still starting (unreachable, not
ready, or the model still loading): then a start-up error naming the model, the version, the key
and what Triton answered. A model Triton does not have, or failed to load, is an error at once.

Labels come from Triton's classification extension: one inference of a blank image asking for
``class_count`` = every output returns ``score:index:label`` for each, which gives each index's
label from the output's ``label_filename``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tritonclient.utils import InferenceServerException

from service.backends.triton_clients import client_module
from service.models.declaration import DeclarationError

if TYPE_CHECKING:
    from service.models.reading import ImageModel

logger = logging.getLogger(__name__)

STARTUP_WAIT = 30.0
"""Seconds a Triton still starting (unreachable, not ready, its model loading) is waited for."""
CALL_TIMEOUT = 5.0
"""Seconds one metadata call may take."""
INFER_TIMEOUT = 60.0
"""Seconds the labels' inference may take (a model's first inference may build its engine)."""
RETRY_EVERY = 0.5


@dataclass(frozen=True)
class FoundModel:
    """A model Triton has loaded, as it describes it."""

    metadata: dict[str, Any]
    """Its model metadata (JSON): inputs and outputs, names, datatypes, shapes."""
    max_batch_size: int
    """Its config's ``max_batch_size`` (0: it batches nothing itself; the shapes hold the batch)."""
    label_files: frozenset[str]
    """Its outputs that have a ``label_filename`` (Triton's classification extension answers them)."""


class _Retry(Exception):
    """Triton may still be starting: ask again until the wait is over."""


class TritonAsker:
    """A synchronous client of one Triton, for the questions asked at start; errors are
    ``DeclarationError`` naming ``where`` (the model and version) and the key."""

    def __init__(self, url: str, protocol: Literal["grpc", "http"], where: str, *, wait: float | None = None) -> None:
        self.url = url
        self.protocol = protocol
        self.where = where
        self.wait = STARTUP_WAIT if wait is None else wait
        self._mod: Any = client_module(protocol)  # HTTP's needs gevent: the triton extra
        kwargs = {} if protocol == "grpc" else {"connection_timeout": CALL_TIMEOUT, "network_timeout": CALL_TIMEOUT}
        self._client: Any = self._mod.InferenceServerClient(url, **kwargs)

    def __enter__(self) -> TritonAsker:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._client.close()

    def _call(self, method: str, *args: Any, json: bool = False, timeout: float = CALL_TIMEOUT, **kwargs: Any) -> Any:
        if self.protocol == "grpc":
            kwargs["client_timeout"] = timeout
            if json:
                kwargs["as_json"] = True
        return getattr(self._client, method)(*args, **kwargs)

    def _error(self, key: str, problem: str) -> DeclarationError:
        return DeclarationError(f"{self.where}: {key}: {problem}")

    def model(self, model: str, version: str) -> FoundModel:
        """The model's metadata and config, once Triton has it loaded (waiting up to ``wait``
        seconds for a Triton still starting)."""
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return self._model(model, version)
            except _Retry as retry:
                left = deadline - time.monotonic()
                if left <= 0:
                    key, problem = retry.args
                    hint = (
                        "; start it first, or declare input_size, layout, input_dtype and labels so that the "
                        "gateway starts without asking it"
                        if key == "triton_url"
                        else ""
                    )
                    raise self._error(key, f"{problem}, after waiting {self.wait:g} s{hint}") from None
                logger.info("waiting for Triton at %s: %s", self.url, retry.args[1])
                time.sleep(min(RETRY_EVERY, left))

    def _model(self, model: str, version: str) -> FoundModel:
        which = f"model {model!r}" + (f" version {version}" if version else "")
        try:
            if not self._call("is_server_ready"):
                raise _Retry("triton_url", f"Triton at {self.url} is not ready")
            if not self._call("is_model_ready", model, version):
                raise self._not_ready(model, version, which)
            metadata = self._call("get_model_metadata", model, version, json=True)
            config = self._call("get_model_config", model, version, json=True)
        except (InferenceServerException, OSError) as exc:
            raise _Retry("triton_url", f"Triton at {self.url} does not answer ({_said(exc)})") from None
        if self.protocol == "grpc":
            config = config.get("config", {}) if isinstance(config, dict) else {}
        if not isinstance(metadata, dict) or not isinstance(config, dict):
            raise self._error("triton_model", f"Triton's answers for {which} are not JSON objects")
        try:
            max_batch_size = int(config.get("max_batch_size", 0))
        except (TypeError, ValueError):
            raise self._error("triton_model", f"{which}'s max_batch_size on Triton is not a number") from None
        outputs = config.get("output", [])
        labelled = frozenset(
            str(o.get("name"))
            for o in (outputs if isinstance(outputs, list) else [])
            if isinstance(o, dict) and o.get("label_filename")
        )
        return FoundModel(metadata, max_batch_size, labelled)

    def _not_ready(self, model: str, version: str, which: str) -> Exception:
        """Why Triton does not serve the model, from its repository index: still loading (wait),
        or missing or failed (an error now)."""
        index = self._call("get_model_repository_index", json=True)
        entries = index.get("models", []) if isinstance(index, dict) else index
        entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        mine = [e for e in entries if e.get("name") == model]
        if not mine:
            names = sorted(str(e.get("name")) for e in entries)[:20]
            return self._error(
                "triton_model", f"Triton at {self.url} has no {which} (it has: {', '.join(names) or 'none'})"
            )
        if any(str(e.get("state", "")).upper() == "LOADING" for e in mine):
            return _Retry("triton_model", f"{which} is still loading on Triton at {self.url}")
        states = "; ".join(
            f"version {e.get('version') or '?'} {e.get('state') or 'not loaded'}"
            + (f" ({str(e.get('reason'))[:200]})" if e.get("reason") else "")
            for e in mine
        )
        return self._error("triton_model", f"{which} is not ready on Triton at {self.url}: {states}")

    def labels(self, model: str, version: str, geometry: ImageModel) -> list[str]:
        """Each output's label, by index, from the output's ``label_filename`` on Triton: one
        inference of a blank image asking for every class (``score:index:label`` strings)."""
        from service.backends.triton_datatypes import DATATYPES

        assert geometry.width is not None
        image, result, width = geometry.image, geometry.result, geometry.width
        assert image.shape is not None
        shape = [d if d is not None else 1 for d in image.shape]
        shape[0] = 1
        axes = (2, 3) if geometry.layout == "NCHW" else (1, 2)
        for axis, side in zip(axes, geometry.input_size, strict=True):
            shape[axis] = side
        tensor = self._mod.InferInput(image.name, shape, DATATYPES[image.dtype])
        blank = np.zeros(shape, np.dtype(image.dtype))
        binary = {} if self.protocol == "grpc" else {"binary_data": True}
        tensor.set_data_from_numpy(blank, **binary)
        wanted = self._mod.InferRequestedOutput(result.name, class_count=width, **binary)
        try:
            answer = self._call(
                "infer", model, [tensor], model_version=version, outputs=[wanted], timeout=INFER_TIMEOUT
            ).as_numpy(result.name)
        except (InferenceServerException, OSError) as exc:
            raise self._error("labels", f"Triton did not give model {model!r}'s labels: {_said(exc)}") from None
        return _labels(answer, width, lambda problem: self._error("labels", f"model {model!r} on Triton: {problem}"))


def _labels(answer: Any, width: int, error: Any) -> list[str]:
    """The labels by index, from the classification extension's ``score:index:label`` strings."""
    found: dict[int, str] = {}
    entries = np.asarray(answer).reshape(-1) if answer is not None else np.empty(0)
    for entry in entries[:width]:
        raw = entry if isinstance(entry, bytes) else str(entry).encode()
        try:
            parts = raw.decode().split(":", 2)
            index = int(parts[1])
        except (UnicodeDecodeError, IndexError, ValueError):
            raise error(f"its classification answer {raw[:80]!r} is not score:index:label") from None
        if len(parts) == 3 and 0 <= index < width:
            found[index] = parts[2]
    if len(found) != width:
        missing = [next(i for i in range(width) if i not in found)]  # the first, found without a set of width
        raise error(
            f"its label_filename gives labels for {len(found)} of its {width} outputs (none for output "
            f"{missing[0]}): one line per output"
        )
    return [found[i] for i in range(width)]


def _said(exc: BaseException) -> str:
    """What Triton (or the connection) said, on one line."""
    text = exc.message() if isinstance(exc, InferenceServerException) and exc.message() else str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:200]
