"""The Triton backend: batches go to NVIDIA Triton Inference Server over asynchronous gRPC (the
default) or HTTP, as uint8 NHWC tensors, optionally through system shared memory.

A model already in the user's Triton, declared without a file (``declared``: its profile, source
format ``triton``), takes its own element type and layout under its own tensor names: the declared
arithmetic is done in NumPy off the event loop (``service.backends.arithmetic``), the output read by
its name and made the gateway's float32 rows (softmax or sigmoid applied as declared). Its names
come from Triton's metadata, checked against the declaration at every readiness check
(``service.backends.triton_declared.check_on_triton``).

One long-lived client per process, opened in the lifespan. Triton's failures are mapped here, at the
adapter edge, to the gateway's errors: unreachable or not ready -> 503, "exceeds maximum queue size"
-> 429, deadline -> 504, anything else (a wrong shape or type included) -> 500 with a log line.
A traced batch's context goes along in the request headers (W3C ``traceparent``, gRPC metadata or
HTTP), so a Triton started with ``--trace-config mode=opentelemetry`` puts its spans in that trace.
Connections are re-established by the clients themselves, so the gateway recovers when Triton comes
back without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import aiohttp
import numpy as np
from tritonclient.utils import InferenceServerException

from service.backends.arithmetic import model_input, rows
from service.backends.base import BackendDefaults, BatchBuffer, Images
from service.backends.triton_clients import client_module
from service.backends.triton_datatypes import DATATYPES
from service.backends.triton_declared import check_on_triton
from service.backends.triton_shm import SharedMemoryPool
from service.errors import BackendError, BackendUnavailable, DeadlineExceeded, GatewayError, QueueFull
from service.models.profiles import ModelProfile
from service.models.tensors import INPUT_NAME, OUTPUT_NAME
from service.tracing import current_headers

logger = logging.getLogger(__name__)

_UNAVAILABLE = {"StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND", "StatusCode.CANCELLED", "503", "404"}


class _RegionsLost(Exception):
    """Triton does not know our shared-memory regions (it restarted)."""


class TritonBackend(BackendDefaults):
    name = "triton"

    def __init__(
        self,
        *,
        url: str,
        model: str,
        version: str = "",
        protocol: Literal["grpc", "http"] = "grpc",
        input_size: tuple[int, int] = (224, 224),
        classes: int = 1000,
        max_batch_size: int = 16,
        shared_memory: bool = False,
        shared_memory_regions: int = 2,
        declared: ModelProfile | None = None,
    ) -> None:
        if declared is not None and (declared.source is None or declared.source.format != "triton"):
            raise ValueError("declared: the profile of a model in Triton (source format triton)")
        if declared is not None and shared_memory:
            raise ValueError("a model in Triton in its own element type and layout is sent over the socket")
        self.url = url
        self.model = model
        self.version = version
        self.protocol = protocol
        self.input_size = input_size
        self.classes = classes
        self.max_batch_size = max_batch_size
        self._use_shm = shared_memory
        self._shm_regions = shared_memory_regions
        self._client: Any = None
        self._mod: Any = None
        self._shm: SharedMemoryPool | None = None
        self._buffer = BatchBuffer()
        self._last_problem: str | None = None
        """The readiness check's last problem (its detail is logged when it changes)."""
        self.declared = declared
        self._names: tuple[str, str] | None = None
        """A declared model's input and output names, as Triton's metadata last gave them."""
        if declared is not None and declared.source is not None and declared.source.input_name:
            self._names = (declared.source.input_name, declared.source.output_name)
        self._learning = asyncio.Lock()

    async def start(self) -> None:
        mod = client_module(self.protocol, aio=True)
        self._mod = mod
        self._client = mod.InferenceServerClient(self.url)
        if self._use_shm:
            height, width = self.input_size
            self._shm = SharedMemoryPool(
                self._shm_regions, self.max_batch_size * height * width * 3, self.max_batch_size * self.classes * 4
            )
        logger.info(
            "triton backend: model %s over %s%s",
            self.model,
            self.protocol,
            " with shared memory" if self._use_shm else "",
        )
        logger.debug("triton backend: model %s at %s", self.model, self.url)

    # -- inference -------------------------------------------------------------------------------

    def _tensors(self, batch: np.ndarray) -> tuple[Any, Any]:
        inp = self._mod.InferInput(INPUT_NAME, list(batch.shape), "UINT8")
        if self.protocol == "grpc":
            inp.set_data_from_numpy(batch)
            return inp, self._mod.InferRequestedOutput(OUTPUT_NAME)
        inp.set_data_from_numpy(batch, binary_data=True)
        return inp, self._mod.InferRequestedOutput(OUTPUT_NAME, binary_data=True)

    async def _call(self, inputs: list[Any], outputs: list[Any], timeout: float | None) -> Any:
        kwargs: dict[str, Any] = {"model_version": self.version, "outputs": outputs}
        if self.protocol == "grpc" and timeout is not None:
            kwargs["client_timeout"] = timeout
        headers = current_headers()  # a traced batch: Triton joins its trace
        if headers:
            kwargs["headers"] = headers
        return await self._client.infer(self.model, inputs, **kwargs)

    async def _infer_socket(self, images: Images, timeout: float | None) -> np.ndarray:
        # Serialised into the request at once (one copy), so one buffer serves every call
        inp, out = self._tensors(self._buffer.assemble(images))
        result = await self._call([inp], [out], timeout)
        return np.asarray(result.as_numpy(OUTPUT_NAME))

    def _model_tensor(self, images: Images, name: str) -> Any:
        """The images in the declared model's element type and layout, serialised into the request
        in a worker thread (the thread's batch buffer may be the very array sent: it is copied here,
        before the thread assembles another batch into it)."""
        assert self.declared is not None
        assert self.declared.source is not None
        batch = model_input(self._buffer.assemble(images), self.declared.source.arithmetic)
        tensor = self._mod.InferInput(name, list(batch.shape), DATATYPES[batch.dtype.name])
        tensor.set_data_from_numpy(batch, **({} if self.protocol == "grpc" else {"binary_data": True}))
        return tensor

    async def _infer_declared(self, images: Images, timeout: float | None) -> np.ndarray:
        assert self.declared is not None
        if self._names is None:
            await self._learn_names()
        assert self._names is not None
        input_name, output_name = self._names
        inp = await asyncio.to_thread(self._model_tensor, images, input_name)
        binary = {} if self.protocol == "grpc" else {"binary_data": True}
        result = await self._call([inp], [self._mod.InferRequestedOutput(output_name, **binary)], timeout)
        raw = result.as_numpy(output_name)
        try:
            if raw is None:
                raise ValueError(f"no output {output_name!r} in the answer")
            return await asyncio.to_thread(rows, np.asarray(raw), self.declared.output, self.classes)
        except ValueError as exc:
            logger.error("triton: model %s answered what its declaration does not say: %s", self.model, exc)
            raise BackendError(f"Triton's model {self.model} did not answer {self.classes} scores per image") from exc

    async def _learn_names(self) -> None:
        """A declared model's tensor names, from Triton's metadata, before its first batch."""
        async with self._learning:
            if self._names is None and (problem := await self._metadata_problem()) is not None:
                raise BackendUnavailable(problem)

    async def _infer_shm(self, images: Images, timeout: float | None) -> np.ndarray:
        assert self._shm is not None
        pair = await self._shm.acquire(self._client)
        try:
            shape = [len(images), *images[0].shape]
            written = self._shm.write(pair.input, images)  # each image straight into the region
            inp = self._mod.InferInput(INPUT_NAME, shape, "UINT8")
            inp.set_shared_memory(pair.input.name, written)
            out = self._mod.InferRequestedOutput(OUTPUT_NAME)
            out_bytes = len(images) * self.classes * 4
            out.set_shared_memory(pair.output.name, out_bytes)
            await self._call([inp], [out], timeout)
            scores = self._shm.read(pair.output, (len(images), self.classes))
        except BaseException as exc:
            await self._shm.discard(pair, self._client)
            if isinstance(exc, InferenceServerException) and "shared memory region" in str(exc).lower():
                self._shm.forget_registrations()
                raise _RegionsLost from exc
            raise
        self._shm.release(pair)
        return scores

    async def infer(self, images: Images, *, timeout: float | None = None) -> np.ndarray:
        if self._client is None:
            raise BackendUnavailable("triton backend is not started")
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline passed before the batch reached Triton")
        try:
            async with asyncio.timeout(timeout):
                if self.declared is not None:
                    return await self._infer_declared(images, timeout)
                if self._shm is None:
                    return await self._infer_socket(images, timeout)
                try:
                    return await self._infer_shm(images, timeout)
                except _RegionsLost:
                    logger.warning("triton: shared-memory regions were lost (Triton restarted?); registering again")
                    return await self._infer_shm(images, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"Triton did not answer within the request deadline ({timeout:.3f} s)") from None
        except InferenceServerException as exc:
            raise self._map(exc) from exc
        except _RegionsLost as exc:
            raise self._map(exc.__cause__) from exc
        except (aiohttp.ClientError, OSError) as exc:
            logger.warning("triton at %s is unreachable: %s", self.url, exc)
            raise BackendUnavailable(f"Triton is unreachable ({type(exc).__name__})") from exc

    def _map(self, exc: InferenceServerException) -> GatewayError:
        status = str(exc.status() or "")
        message = exc.message() or str(exc)
        if "exceeds maximum queue size" in message.lower():
            return QueueFull(f"Triton's queue for {self.model} is full; retry later")
        if status == "StatusCode.DEADLINE_EXCEEDED":
            return DeadlineExceeded("Triton did not answer within the request deadline")
        # Triton's message may name its address, paths or shared-memory regions: the log has it
        if status in _UNAVAILABLE or "not ready" in message.lower() or "unknown model" in message.lower():
            logger.warning("triton at %s cannot serve %s (%s): %s", self.url, self.model, status, message)
            return BackendUnavailable(f"Triton cannot serve {self.model} now")
        logger.error("triton rejected a batch for %s (%s): %s", self.model, status or "no status", message)
        return BackendError("Triton failed on the batch")

    # -- readiness -------------------------------------------------------------------------------

    async def _metadata_problem(self) -> str | None:
        """Check that the model takes what the gateway sends, in batches as large as the gateway's:
        at every readiness check (two calls), since Triton may have loaded another model under the
        name since the last (an operator's load, its repository polled)."""
        if self.protocol == "grpc":
            meta = await self._client.get_model_metadata(self.model, self.version, as_json=True)
        else:
            meta = await self._client.get_model_metadata(self.model, self.version)
        if self.declared is not None:
            now, problem = check_on_triton(self.declared, meta, self.max_batch_size, f"model {self.model!r} on Triton")
            if problem is not None:
                self._names = None  # the next batch checks again, and is refused while this lasts
                logger.error("triton: %s", problem)
                return problem
            assert now is not None
            assert now.source is not None
            self._names = (now.source.input_name, now.source.output_name)
            return await self._config_problem()
        height, width = self.input_size
        inputs = {i["name"]: (i["datatype"], [int(d) for d in i["shape"]]) for i in meta.get("inputs", [])}
        outputs = {o["name"]: (o["datatype"], [int(d) for d in o["shape"]]) for o in meta.get("outputs", [])}
        want_in = ("UINT8", [-1, height, width, 3])
        want_out = ("FP32", [-1, self.classes])
        if inputs.get(INPUT_NAME) != want_in or outputs.get(OUTPUT_NAME) != want_out:
            problem = (
                f"model {self.model} on Triton takes {inputs} and gives {outputs}; the gateway sends "
                f"{INPUT_NAME} {want_in} and reads {OUTPUT_NAME} {want_out}"
            )
            logger.error("triton: %s", problem)
            return problem
        return await self._config_problem()

    async def _config_problem(self) -> str | None:
        """Whether Triton's model takes batches as large as the gateway's."""
        if self.protocol == "grpc":
            config = (await self._client.get_model_config(self.model, self.version, as_json=True)).get("config", {})
        else:
            config = await self._client.get_model_config(self.model, self.version)
        triton_max = int(config.get("max_batch_size", 0))
        if triton_max and self.max_batch_size > triton_max:
            problem = (
                f"the gateway's max_batch_size {self.max_batch_size} exceeds model {self.model}'s max_batch_size "
                f"{triton_max} on Triton: every full batch would be refused; set GATEWAY_MAX_BATCH_SIZE <= {triton_max}"
            )
            logger.error("triton: %s", problem)
            return problem
        return None

    async def ready(self) -> str | None:
        if self._client is None:
            return "triton backend is not started"
        try:
            async with asyncio.timeout(2.0):
                if not await self._client.is_server_ready():
                    return self._problem("Triton is not ready", "")
                if not await self._client.is_model_ready(self.model, self.version):
                    return self._problem(f"model {self.model} is not ready on Triton", "")
            async with asyncio.timeout(2.0):  # its own time: two calls more must not make a busy Triton look gone
                self._last_problem = await self._metadata_problem()
                return self._last_problem
        except (TimeoutError, InferenceServerException, aiohttp.ClientError, OSError) as exc:
            return self._problem(f"Triton is unreachable ({type(exc).__name__})", exc)

    def _problem(self, problem: str, detail: object) -> str:
        """``problem`` as /readyz and answers say it (no address); logged once while it lasts with
        Triton's address and ``detail``, for the operator."""
        if problem != self._last_problem:
            logger.warning("triton at %s: %s%s", self.url, problem, f" ({detail})" if detail else "")
        self._last_problem = problem
        return problem

    async def aclose(self) -> None:
        if self._shm is not None:
            await self._shm.aclose(self._client)
        if self._client is not None:
            await self._client.close()
            self._client = None
