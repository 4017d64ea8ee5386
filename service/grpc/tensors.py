"""Reading a ``ModelInferRequest`` and writing its ``ModelInferResponse``: the REST front's tensors
(``service.http.inference_request``) in protobuf form.

The model takes one input, ``IMAGE``: a ``BYTES`` tensor of shape ``[N]`` or ``[N, 1]``, each
element one encoded image, in ``raw_input_contents`` (the protocol's BYTES serialization: a 4-byte
little-endian length before each element; what ``tritonclient.grpc`` sends) or in the tensor's
``contents.bytes_contents``. Every count is checked before an element is touched: the message was
parsed by the server within ``max_receive_message_length``, and here nothing is built per element
until the count is known to be at most the image limit.

The output, ``PROBABILITIES``, is ``FP32 [N, outputs]`` in ``raw_output_contents``; with the
classification extension (the requested output's ``classification`` parameter) it is ``BYTES
[N, k]``, each element ``"score:index:label"``, best first, as Triton gives it.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from tritonclient.grpc import service_pb2

from service.classifier import Classification, ImageInput
from service.errors import BadRequest
from service.http.inference_request import INPUT, OUTPUT, InferenceRequest, bytes_elements
from service.http.inference_shapes import OutputTensor
from service.serving.served import quoted

CONTENT_FIELDS = (
    "bool_contents",
    "int_contents",
    "int64_contents",
    "uint_contents",
    "uint64_contents",
    "fp32_contents",
    "fp64_contents",
)
"""The typed contents a BYTES input must leave empty."""


def read_infer(request: Any, max_images: int, classes: int) -> InferenceRequest:
    """The images and the asked output of ``request`` (a ``ModelInferRequest``); 400 for anything wrong."""
    if len(request.inputs) != 1:
        raise BadRequest(
            f"inputs must hold one tensor, {INPUT!r} (BYTES, shape [N] or [N,1]); got {len(request.inputs)}"
        )
    tensor = request.inputs[0]
    if tensor.name != INPUT:
        raise BadRequest(f"unknown input {tensor.name[:64]!r}; this model takes {INPUT!r}")
    if tensor.datatype != "BYTES":
        raise BadRequest(
            f"input {INPUT!r} must be BYTES (each element one encoded image); got {tensor.datatype[:16]!r}"
        )
    if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
        shown = list(tensor.shape[:4]) + (["..."] if len(tensor.shape) > 4 else [])
        raise BadRequest(f"input {INPUT!r} must have shape [N] or [N,1]; got {shown}")
    count = tensor.shape[0]
    if not 1 <= count <= max_images:
        raise BadRequest(f"input {INPUT!r} holds {count} images; 1 to {max_images} per request")
    contents = tensor.contents
    if any(len(getattr(contents, field)) for field in CONTENT_FIELDS):
        raise BadRequest(f"input {INPUT!r} is BYTES: its data goes in bytes_contents or raw_input_contents")
    raw = request.raw_input_contents
    if len(raw) > 1:
        raise BadRequest(f"raw_input_contents holds {len(raw)} tensors; this model takes one input")
    given = len(contents.bytes_contents)
    if raw:
        if given:
            raise BadRequest(f"input {INPUT!r} has both bytes_contents and raw_input_contents")
        elements = bytes_elements(memoryview(raw[0]), count)
    elif given != count:
        raise BadRequest(f"input {INPUT!r} has shape {list(tensor.shape)} but holds {given} elements")
    else:
        elements = list(contents.bytes_contents)
    if len(elements) != count:
        raise BadRequest(f"input {INPUT!r} has shape {list(tensor.shape)} but holds {len(elements)} elements")
    images = [ImageInput(data, f"{INPUT}[{i}]") for i, data in enumerate(elements)]
    return InferenceRequest(images, _classification(request, classes), True, request.id or None)


def request_deadline(request: Any, deadline: float | None, now: float) -> float | None:
    """The sooner of the call's ``deadline`` (event-loop time) and the request's own ``timeout``
    parameter (microseconds, what ``tritonclient``'s ``infer(timeout=...)`` sends for Triton's
    server-side timeout). A sequence (stateful) request is refused: no model here keeps state."""
    parameters = request.parameters
    for name in ("sequence_id", "sequence_start", "sequence_end"):
        kind = parameters[name].WhichOneof("parameter_choice") if name in parameters else None
        if kind is not None and getattr(parameters[name], kind):
            raise BadRequest(f"{name}: this gateway serves no sequence (stateful) models")
    if "timeout" not in parameters:
        return deadline
    parameter = parameters["timeout"]
    kind = parameter.WhichOneof("parameter_choice")
    micros: int | None = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    if micros is None or micros < 0:
        raise BadRequest("the timeout parameter must be a whole number of microseconds")
    if micros == 0:
        return deadline  # Triton's "no timeout"
    own: float = now + micros / 1e6
    return own if deadline is None else min(deadline, own)


def _classification(request: Any, classes: int) -> int | None:
    """The requested output's ``classification`` k (None: the scores)."""
    if not request.outputs:
        return None
    if len(request.outputs) != 1:
        raise BadRequest(f"outputs must name one tensor, {OUTPUT!r}; got {len(request.outputs)}")
    wanted = request.outputs[0]
    if wanted.name != OUTPUT:
        raise BadRequest(f"unknown output {wanted.name[:64]!r}; this model gives {OUTPUT!r}")
    if "classification" not in wanted.parameters:
        return None
    parameter = wanted.parameters["classification"]
    kind = parameter.WhichOneof("parameter_choice")
    k = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    if k is None or not 1 <= k <= classes:
        shown = getattr(parameter, kind) if kind else None
        said = quoted(shown, 32, "string") if isinstance(shown, str) else repr(shown)
        raise BadRequest(f"classification must be a whole number of classes from 1 to {classes}; got {said}")
    return cast(int, k)


def infer_response(
    model: str, version: str, request_id: str | None, rows: list[np.ndarray] | list[Classification]
) -> Any:
    """The ``ModelInferResponse`` for ``rows``: score rows as FP32, ranked classes as BYTES."""
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=request_id or "")
    output = OutputTensor.of(rows)
    response.outputs.add(name=OUTPUT, datatype=output.datatype, shape=output.shape)
    response.raw_output_contents.append(output.raw())
    return response
