"""Reading an Open Inference Protocol (KServe v2) REST inference request, with work bounded by the
image limit before a tensor element is parsed.

The envelope is a JSON header, then (with the binary tensor data extension) the tensors' bytes:
``Inference-Header-Content-Length`` says where the header ends. What reading costs is fixed by the
limits before it begins:

* the header length is ASCII digits, at most as many as the body's length has (``"²"`` and a
  5,000-digit number are 400s, not a failed ``int()``);
* the header is parsed only if it holds at most ``values_limit(max_images)`` JSON values, counted
  without parsing (``strict_json.values_at_most``), so a body of millions of tiny elements is
  refused before a Python object is built for one; it is strict JSON (duplicate keys, NaN and
  deep nesting are 400s), and a large one is parsed off the event loop;
* the binary tensor data is split into at most the tensor's declared element count, itself at most
  ``max_images``; a longer one is refused without reading the rest.

Errors are ``BadRequest`` (400) naming what was wrong; ``inference_protocol`` renders them in the
protocol's shape.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from service.classifier import ImageInput
from service.errors import BadRequest
from service.http import strict_json
from service.serving.served import quoted

INPUT = "IMAGE"
OUTPUT = "PROBABILITIES"
HEADER_LENGTH = "Inference-Header-Content-Length"
INLINE_PARSE_BYTES = 16 * 1024
"""Bodies up to this size (a binary request's header, small JSON ones) are read on the event loop;
larger ones (images in base64 JSON) in a worker thread."""
ENVELOPE_VALUES = 256
"""JSON values an inference request may hold besides its images' elements (names, shapes,
parameters, the requested outputs, the id), generously."""
_DIGITS = re.compile(r"[0-9]+")


def values_limit(max_images: int) -> int:
    """The most JSON values a valid request of ``max_images`` images holds: each image's element,
    and the list around it for shape ``[N, 1]``, and the envelope."""
    return 2 * max_images + ENVELOPE_VALUES


@dataclass(frozen=True)
class InferenceRequest:
    """What an inference request asks: its images, and of its output the classification's ``k``
    (None: the probabilities over every class) and whether it is wanted in binary."""

    images: list[ImageInput]
    k: int | None
    binary_output: bool
    id: str | None


async def read_request(body: bytes, header_length: str | None, max_images: int, classes: int) -> InferenceRequest:
    """The request in ``body`` (``header_length``: the extension's header, if sent), checked;
    400 for anything wrong."""
    if len(body) > INLINE_PARSE_BYTES:
        return await run_in_threadpool(parse_request, body, header_length, max_images, classes)
    return parse_request(body, header_length, max_images, classes)


def parse_request(body: bytes, header_length: str | None, max_images: int, classes: int) -> InferenceRequest:
    """``read_request``'s work (pure; run in a thread for large bodies)."""
    header, binary = _split(body, header_length, max_images)
    images = _images(header, binary, max_images)
    k, binary_output = _requested(header, classes)
    request_id = header.get("id")
    return InferenceRequest(images, k, binary_output, request_id if isinstance(request_id, str) else None)


def _split(body: bytes, header_length: str | None, max_images: int) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON header and what follows it (the binary tensor data)."""
    if header_length is None:
        length = len(body)
    else:
        value = header_length.strip()
        # ASCII digits only ("²" is a digit to str.isdigit, not to int()), and no more of them than
        # the body's own length has (a 5,000-digit number is over int()'s limit, and no body's)
        if not _DIGITS.fullmatch(value) or len(value) > len(str(len(body))) or int(value) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be a number of bytes within the body ({len(body)})")
        length = int(value)
    most = values_limit(max_images)
    if not strict_json.values_at_most(body, most, length):  # counted in place: no copy of a hostile body
        raise BadRequest(
            f"the inference request's header holds over {most} JSON values; a request of up to {max_images} "
            "images (GATEWAY_MAX_IMAGES_PER_REQUEST) needs fewer"
        )
    what = "the inference request's header is not JSON"
    header = strict_json.loads(strict_json.utf8(body[:length], what), what)
    if not isinstance(header, dict):
        raise BadRequest("the inference request must be a JSON object")
    return header, memoryview(body)[length:]


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return value


def _images(header: dict[str, Any], binary: memoryview, most: int) -> list[ImageInput]:
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadRequest(f"inputs must hold one tensor, {INPUT!r} (BYTES, shape [N] or [N,1])")
    tensor = inputs[0]
    if tensor.get("name") != INPUT:
        raise BadRequest(f"unknown input {tensor.get('name')!r}; this model takes {INPUT!r}")
    if tensor.get("datatype") != "BYTES":
        raise BadRequest(f"input {INPUT!r} must be BYTES (each element one encoded image)")
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) not in (1, 2)
        or not all(type(d) is int for d in shape)
        or (len(shape) == 2 and shape[1] != 1)
    ):
        raise BadRequest(f"input {INPUT!r} must have shape [N] or [N,1]; got {shape!r}")
    count = shape[0]
    if not 1 <= count <= most:
        raise BadRequest(f"input {INPUT!r} holds {count} images; 1 to {most} per request")
    parameters = _object(tensor.get("parameters"), f"input {INPUT!r}'s parameters")
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size != len(binary):
            raise BadRequest(
                f"binary_data_size ({size!r}) must be the {len(binary)} bytes after the header (one input)"
            )
        if "data" in tensor:
            raise BadRequest(f"input {INPUT!r} has both data and binary_data_size")
        elements = bytes_elements(binary, count)
    else:
        if len(binary):
            raise BadRequest("bytes after the JSON header, but no input gives a binary_data_size")
        elements = _base64_elements(tensor.get("data"))
    if len(elements) != count:
        raise BadRequest(f"input {INPUT!r} has shape {shape} but holds {len(elements)} elements")
    return [ImageInput(data, f"{INPUT}[{i}]") for i, data in enumerate(elements)]


def bytes_elements(binary: memoryview, count: int) -> list[bytes]:
    """The protocol's BYTES serialization: each element a 4-byte little-endian length, then it; at
    most ``count`` of them are read (more is an error, found without reading the rest)."""
    elements: list[bytes] = []
    at = 0
    while at < len(binary):
        if len(elements) == count:
            raise BadRequest(
                f"input {INPUT!r} has shape [{count}] but its binary data goes on after {count} elements "
                f"({len(binary) - at} bytes more)"
            )
        if at + 4 > len(binary):
            raise BadRequest("the binary tensor data ends inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", binary, at)
        at += 4
        if at + length > len(binary):
            raise BadRequest(f"a binary tensor element says {length} bytes; {len(binary) - at} are left")
        elements.append(bytes(binary[at : at + length]))
        at += length
    return elements


def _base64_elements(data: Any) -> list[bytes]:
    flat = data
    if isinstance(flat, list) and flat and all(isinstance(row, list) for row in flat):
        flat = [element for row in flat for element in row]  # [[...], [...]] for shape [N,1]
    if not isinstance(flat, list) or not all(isinstance(element, str) for element in flat):
        raise BadRequest(f"input {INPUT!r}: data must be a list of base64 strings (one image each)")
    try:
        return [base64.b64decode(element, validate=True) for element in flat]
    except (binascii.Error, ValueError):
        raise BadRequest(f"input {INPUT!r}: an element of data is not base64") from None


def _requested(header: dict[str, Any], classes: int) -> tuple[int | None, bool]:
    """What the request asks of the output: classification's k (None: probabilities), binary."""
    parameters = _object(header.get("parameters"), "the request's parameters")
    binary = parameters.get("binary_data_output", False) is True
    outputs = header.get("outputs")
    if outputs is None:
        return None, binary
    if not isinstance(outputs, list) or len(outputs) != 1 or not isinstance(outputs[0], dict):
        raise BadRequest(f"outputs must name one tensor, {OUTPUT!r}")
    if outputs[0].get("name") != OUTPUT:
        raise BadRequest(f"unknown output {outputs[0].get('name')!r}; this model gives {OUTPUT!r}")
    wanted = _object(outputs[0].get("parameters"), f"output {OUTPUT!r}'s parameters")
    binary = wanted.get("binary_data", binary) is True
    k = wanted.get("classification")
    if k is None:
        return None, binary
    if type(k) is not int or not 1 <= k <= classes:
        said = quoted(k, 32, "string") if isinstance(k, str) else repr(k)[:64]
        raise BadRequest(f"classification must be a whole number of classes from 1 to {classes}; got {said}")
    return k, binary
