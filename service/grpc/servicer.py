"""``inference.GRPCInferenceService``: each method answers as Triton's does, from the same state
and through the same door as the REST front (``service.http.gateway.online``), so a gRPC client
gets the gateway's admission, quotas, fair sharing, deadlines and cancellation. The answers' shapes
are built once for both protocols (``service.http.inference_shapes``) and parsed into the protos
here. What the gateway does not do (shared memory, trace and log settings) is UNIMPLEMENTED with a
message that says so."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from service.errors import BadRequest
from service.grpc.calls import Caller, Calls
from service.grpc.methods import Malformed
from service.grpc.streams import answer_stream
from service.grpc.tensors import infer_response, read_infer, request_deadline
from service.http import inference_shapes
from service.http.gateway import choose, online
from service.http.model_routes import check_admin_key, set_loaded
from service.serving.served import quoted

Context: TypeAlias = Any
"""``grpc.aio.ServicerContext`` (grpcio ships no type hints)."""
logger = logging.getLogger(__name__)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.gateway = calls.gateway

    async def ServerLive(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ServerLive", context):
            return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ServerReady", context):
            return service_pb2.ServerReadyResponse(ready=inference_shapes.serving(self.gateway))

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ServerMetadata", context):
            return json_format.ParseDict(inference_shapes.server_metadata(), service_pb2.ServerMetadataResponse())

    async def ModelReady(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ModelReady", context):
            model = self.gateway.models.get(_name(request.name))
            problem = model.problem if not request.version else model.version(request.version).problem
            return service_pb2.ModelReadyResponse(ready=problem is None and not self.gateway.closing)

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ModelMetadata", context):
            model = self.gateway.models.get(_name(request.name))
            versions = list(model.versions.values()) if not request.version else [model.version(request.version)]
            shape = inference_shapes.model_metadata(self.gateway, model, versions)
            return json_format.ParseDict(shape, service_pb2.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ModelConfig", context):
            # as GET .../config: the named version, or the model's first (not one picked by traffic)
            model = self.gateway.models.get(_name(request.name))
            served = model.version(request.version) if request.version else next(iter(model.versions.values()))
            config = json_format.ParseDict(
                inference_shapes.model_config(self.gateway, served), model_config_pb2.ModelConfig()
            )
            return service_pb2.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ModelStatistics", context):
            shape = inference_shapes.model_statistics(self.gateway, request.name or None, request.version or None)
            return json_format.ParseDict(shape, service_pb2.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: Any, context: Context) -> Any:
        async with self.calls.call("RepositoryIndex", context):
            if request.repository_name:
                raise BadRequest("this gateway has one repository: leave repository_name empty")
            models = inference_shapes.repository_index(self.gateway, request.ready)
            return service_pb2.RepositoryIndexResponse(
                models=[json_format.ParseDict(m, service_pb2.RepositoryIndexResponse.ModelIndex()) for m in models]
            )

    async def ModelInfer(self, request: Any, context: Context) -> Any:
        async with self.calls.call("ModelInfer", context) as caller:
            return await self._infer(request, caller)

    async def ModelStreamInfer(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        """Each request of the stream answered as ``ModelInfer`` answers it, in the order they finish
        (a client matches them by ``id``, as ``tritonclient.grpc``'s stream callback does); an error
        is that request's ``error_message``, and the stream goes on (``service.grpc.streams``). The
        stream's key and deadline are its call's; a request's deadline is also bounded by
        ``request_timeout``, and each request takes the key's concurrency slot."""
        async with self.calls.call("ModelStreamInfer", context, holds_slot=False) as caller:
            answers = answer_stream(
                request_iterator,
                caller,
                self.calls,
                self._infer,
                lambda: self.gateway.closing,
                self.gateway.settings.max_body_bytes,
            )
            async with contextlib.aclosing(answers):  # closed with the call, whatever ends it
                async for response in answers:
                    yield response

    async def _infer(self, request: Any, caller: Caller) -> Any:
        if isinstance(request, Malformed):  # a stream's request (a unary call's is refused before)
            raise request.refusal()
        served = self._version(caller, request.model_name, request.model_version)
        gateway = self.gateway
        gateway.models.check(served)  # full now: refuse before the tensors are read
        asked = read_infer(request, gateway.settings.max_images_per_request, served.spec.profile.outputs)
        deadline = request_deadline(request, caller.deadline, asyncio.get_running_loop().time())
        rows = await online(gateway, caller.key_id, served, asked.images, asked.k, deadline)
        return infer_response(served.model, served.version, asked.id, rows)

    def _version(self, caller: Caller, name: str, version: str) -> Any:
        return choose(self.gateway, caller.key_id, _name(name), version or None)

    async def _unimplemented(self, method: str, context: Context, what: str) -> Any:
        async with self.calls.call(method, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this gateway does not support {what}")

    async def RepositoryModelLoad(self, request: Any, context: Context) -> Any:
        """As ``POST /v2/repository/models/{name}/load``, with the admin key as ``x-admin-key``
        metadata; a configuration or files sent with the load are refused (the models file
        declares the model)."""
        async with self.calls.call("RepositoryModelLoad", context) as caller:
            check_admin_key(self.gateway, caller.admin_key)
            if request.repository_name:
                raise BadRequest("this gateway has one repository: leave repository_name empty")
            if request.parameters:
                shown = ", ".join(quoted(key, 64, "key") for key in sorted(request.parameters)[:5])
                raise BadRequest(
                    f"parameters ({shown}) are not supported: the gateway loads a model as its models file "
                    "declares it, without a configuration or files sent with the load"
                )
            await set_loaded(self.gateway, _name(request.model_name), load=True)
            return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Context) -> Any:
        """As ``POST /v2/repository/models/{name}/unload`` (``unload_dependents`` changes nothing:
        there are no ensembles)."""
        async with self.calls.call("RepositoryModelUnload", context) as caller:
            check_admin_key(self.gateway, caller.admin_key)
            if request.repository_name:
                raise BadRequest("this gateway has one repository: leave repository_name empty")
            unknown = sorted(set(request.parameters) - {"unload_dependents"})
            if unknown:
                shown = ", ".join(quoted(key, 64, "key") for key in unknown[:5])
                raise BadRequest(f"unknown parameters ({shown}); an unload takes unload_dependents only")
            dependents = request.parameters.get("unload_dependents")
            if dependents is not None and dependents.WhichOneof("parameter_choice") != "bool_param":
                raise BadRequest("unload_dependents must be a bool parameter")
            await set_loaded(self.gateway, _name(request.model_name), load=False)
            return service_pb2.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("SystemSharedMemoryStatus", context, "shared memory: send the bytes")

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("SystemSharedMemoryRegister", context, "shared memory: send the bytes")

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("SystemSharedMemoryUnregister", context, "shared memory: send the bytes")

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("CudaSharedMemoryStatus", context, "CUDA shared memory: send the bytes")

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("CudaSharedMemoryRegister", context, "CUDA shared memory: send the bytes")

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("CudaSharedMemoryUnregister", context, "CUDA shared memory: send the bytes")

    async def TraceSetting(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("TraceSetting", context, "trace settings: see GATEWAY_TRACING_*")

    async def LogSettings(self, request: Any, context: Context) -> Any:
        return await self._unimplemented("LogSettings", context, "log settings: see GATEWAY_LOG_LEVEL")


def _name(name: str) -> str:
    if not name:
        raise BadRequest("name the model (model_name): every call of the protocol is for one model")
    return name
