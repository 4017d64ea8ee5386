"""Triton's model repository, as the gateway asks about it and controls it: the index (which models
and versions Triton has, and their state), and loading or unloading a model, which Triton allows
when it runs with ``--model-control-mode=explicit``. Triton's refusals come back as ``BadRequest``,
an unreachable Triton as ``BackendUnavailable``; Triton's own message and its address go to the log
only (they name its host, its repository's paths)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from tritonclient.utils import InferenceServerException

from service.backends.triton_clients import client_module
from service.errors import BackendUnavailable, BadRequest

logger = logging.getLogger(__name__)

TIMEOUT = 300.0
"""Seconds a call may take (Triton answers a load when the model is loaded: a TensorRT engine's
build takes minutes)."""


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    """"" when Triton lists the model without a version (not loaded, in explicit mode)."""
    state: str
    """READY, UNAVAILABLE, LOADING..."""


class TritonRepository:
    def __init__(self, url: str, protocol: Literal["grpc", "http"] = "grpc") -> None:
        self.url = url
        self.protocol = protocol

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = client_module(self.protocol, aio=True).InferenceServerClient(self.url)
        try:
            async with asyncio.timeout(TIMEOUT):
                return await getattr(client, method)(*args, **kwargs)
        except TimeoutError as exc:
            logger.warning("triton at %s did not answer %s within %g s", self.url, method, TIMEOUT)
            raise BackendUnavailable(f"Triton did not answer {method} within {TIMEOUT:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            logger.warning("triton at %s is unreachable: %s", self.url, exc)
            raise BackendUnavailable(f"Triton is unreachable ({type(exc).__name__})") from exc
        except InferenceServerException as exc:
            text = exc.message() or str(exc)
            logger.warning("triton at %s: %s %s refused: %s", self.url, method, args, text)
            # a connection that failed; not a model "at UNAVAILABLE state", which is Triton's refusal
            if any(words in text for words in ("failed to connect", "Connection refused", "Socket closed")):
                raise BackendUnavailable("Triton is unreachable") from exc
            raise BadRequest(
                f"Triton refused {method} {', '.join(map(str, args))}; its log and the gateway's say why"
            ) from exc
        finally:
            await client.close()

    async def index(self) -> list[IndexEntry]:
        options = {"as_json": True} if self.protocol == "grpc" else {}
        answer = await self._call("get_model_repository_index", **options)
        models = answer.get("models", []) if isinstance(answer, dict) else answer
        return [
            IndexEntry(str(model.get("name", "")), str(model.get("version", "")), str(model.get("state", "")))
            for model in models
            if isinstance(model, dict)
        ]

    async def load(self, model: str) -> None:
        await self._call("load_model", model)

    async def unload(self, model: str) -> None:
        await self._call("unload_model", model)
