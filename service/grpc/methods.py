"""The service's method table, built from the protos' own service descriptor (the one
``tritonclient`` ships) rather than its generated ``add_..._to_server``: the same methods and
messages, with one difference. Bytes that are not the method's message (malformed or truncated
protobuf) become a ``Malformed`` request, which the call answers with INVALID_ARGUMENT like any bad
request (counted, with its request id); grpcio's own deserialization failure answers UNKNOWN with
no word of what was wrong."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from service.errors import BadRequest
from service.grpc.calls import Calls

SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse as its method's message."""

    message: str
    error: str

    def refusal(self) -> BadRequest:
        return BadRequest(f"the request is not a valid {self.message} protobuf message ({self.error})")


def _parser(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Malformed(message.DESCRIPTOR.name, str(exc)[:200])

    return parse


def _checked(name: str, calls: Calls, behavior: Callable[[Any, Any], Awaitable[Any]]) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed):
            async with calls.call(name, context):
                raise request.refusal()
        return await behavior(request, context)

    return call


def method_handlers(servicer: Any, calls: Calls) -> dict[str, grpc.RpcMethodHandler]:
    """Each method of the service, served by ``servicer``'s method of the same name."""
    handlers = {}
    for method in SERVICE.methods:
        request = getattr(service_pb2, method.input_type.name)
        response = getattr(service_pb2, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            make, wrapped = grpc.stream_stream_rpc_method_handler, behavior  # a Malformed item: that request's error
        elif not method.client_streaming and not method.server_streaming:
            make, wrapped = grpc.unary_unary_rpc_method_handler, _checked(method.name, calls, behavior)
        else:  # the protocol has none; a newer proto's would be served by grpcio's default (UNIMPLEMENTED)
            continue
        handlers[method.name] = make(
            wrapped, request_deserializer=_parser(request), response_serializer=response.SerializeToString
        )
    return handlers


def add_to_server(servicer: Any, calls: Calls, server: Any) -> None:
    handlers = method_handlers(servicer, calls)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
