"""The Open Inference Protocol (KServe v2) on the gateway's port, with the real ``tritonclient.http``
client as an outside client (binary tensor data and JSON), and hostile requests by hand."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from service.backends.fake import FakeBackend
from service.errors import BadRequest
from service.http import strict_json
from service.http.inference_request import parse_request
from service.settings import Settings
from tests.conftest import CAT_CLASSES, png_bytes, running_gateway, solid_image

MakeSettings = Callable[..., Settings]
ESPRESSO = 967


def _client(base_url: str) -> triton_http.InferenceServerClient:
    return triton_http.InferenceServerClient(base_url.removeprefix("http://"), network_timeout=30)


async def ask(base_url: str, method: str, *args: Any) -> Any:
    """One call of the client (made, used and closed in a thread: it blocks, and gevent's
    connections belong to the thread that made them)."""

    def call() -> Any:
        client = _client(base_url)
        try:
            return getattr(client, method)(*args)
        finally:
            client.close()

    return await asyncio.to_thread(call)


def _infer(
    base_url: str, images: list[bytes], *, binary: bool, k: int | None = None, version: str = ""
) -> triton_http.InferResult:
    """``tritonclient.http``'s infer, as an application would call it (in a thread: it blocks)."""
    data = np.array(images, dtype=np.object_)
    tensor = triton_http.InferInput("IMAGE", [len(images)], "BYTES")
    if binary:
        tensor.set_data_from_numpy(data, binary_data=True)
    else:  # JSON: the protocol has no bytes there, so each image is base64 (the gateway's rule)
        tensor.set_data_from_numpy(np.array([base64.b64encode(i) for i in images], dtype=np.object_), binary_data=False)
    output = triton_http.InferRequestedOutput("PROBABILITIES", binary_data=binary, class_count=k or 0)
    client = _client(base_url)
    try:
        return client.infer("efficientnet-lite0", [tensor], model_version=version, outputs=[output])
    finally:
        client.close()


async def test_tritonclient_classifies_real_photos_in_binary_and_json(
    gateway_factory: MakeSettings, cat_jpeg: bytes, coffee_jpeg: bytes
) -> None:
    async with running_gateway(gateway_factory()) as gateway:
        url = str(gateway.base_url)
        assert await ask(url, "is_server_live")
        assert await ask(url, "is_server_ready")
        assert await ask(url, "is_model_ready", "efficientnet-lite0")
        assert not await ask(url, "is_model_ready", "resnet50")
        metadata = await ask(url, "get_model_metadata", "efficientnet-lite0")
        assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1, 1]}]
        assert metadata["outputs"] == [{"name": "PROBABILITIES", "datatype": "FP32", "shape": [-1, 1000]}]

        for binary in (True, False):
            probabilities = (await asyncio.to_thread(_infer, url, [cat_jpeg, coffee_jpeg], binary=binary)).as_numpy(
                "PROBABILITIES"
            )
            assert probabilities.shape == (2, 1000)
            assert probabilities.dtype == np.float32
            assert probabilities.sum(axis=1) == pytest.approx([1.0, 1.0], abs=1e-3)
            assert int(probabilities[0].argmax()) in CAT_CLASSES
            assert int(probabilities[1].argmax()) == ESPRESSO

            ranked = (await asyncio.to_thread(_infer, url, [coffee_jpeg], binary=binary, k=3)).as_numpy("PROBABILITIES")
            assert ranked.shape == (1, 3)
            strings = [text(element) for element in ranked[0]]
            score, index, label = strings[0].split(":", 2)
            assert (int(index), label) == (ESPRESSO, "espresso")
            assert float(score) == pytest.approx(0.94, abs=0.05)
            scores = [float(element.split(":")[0]) for element in strings]
            assert scores == sorted(scores, reverse=True)

        # the same answer as /classify, through the same decode, batcher and backend
        classic = await gateway.post("/classify", content=coffee_jpeg, headers={"content-type": "image/jpeg"})
        best = classic.json()["results"][0]["labels"][0]
        versioned = await asyncio.to_thread(_infer, url, [coffee_jpeg], binary=True, version="1")
        assert float(versioned.as_numpy("PROBABILITIES")[0][ESPRESSO]) == pytest.approx(best["score"], abs=1e-6)
        with pytest.raises(InferenceServerException, match="model 'efficientnet-lite0' has no version '2'"):
            await asyncio.to_thread(_infer, url, [coffee_jpeg], binary=True, version="2")


def text(element: bytes | str) -> str:
    """A BYTES element as tritonclient gives it: bytes from binary data, str from JSON."""
    return element.decode() if isinstance(element, bytes) else element


def _body(header: dict[str, Any], binary: bytes = b"") -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + binary, {
        "Inference-Header-Content-Length": str(len(head)),
        "content-type": "application/octet-stream",
    }


def _elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def _image_input(count: int, size: int | None = None, **extra: Any) -> dict[str, Any]:
    tensor: dict[str, Any] = {"name": "IMAGE", "datatype": "BYTES", "shape": [count], **extra}
    if size is not None:
        tensor["parameters"] = {"binary_data_size": size}
    return {"inputs": [tensor]}


PNG = png_bytes(solid_image(7, 16))
STRAY = json.dumps(_image_input(1, data=[base64.b64encode(PNG).decode()])).encode()


@pytest.mark.parametrize(
    ("header", "binary", "status", "words"),
    [
        ({"inputs": []}, b"", 400, "one tensor"),
        ({"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1]}]}, b"", 400, "unknown input"),
        ({"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": [1]}]}, b"", 400, "must be BYTES"),
        (_image_input(1, data=["not base64!"]), b"", 400, "not base64"),
        (_image_input(2, data=[base64.b64encode(PNG).decode()]), b"", 400, "holds 1 elements"),
        (_image_input(0, data=[]), b"", 400, "1 to 64"),
        (_image_input(65, data=[]), b"", 400, "1 to 64"),
        ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1, 2]}]}, b"", 400, "shape [N] or [N,1]"),
        ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": ["1"]}]}, b"", 400, "shape [N] or [N,1]"),
        (_image_input(1, 999), _elements(PNG), 400, "binary_data_size"),
        (_image_input(1, 10), struct.pack("<I", 1000) + b"x" * 6, 400, "6 are left"),
        (_image_input(1, 2), b"\x01\x00", 400, "4-byte length"),
        (_image_input(1, len(_elements(b"not an image"))), _elements(b"not an image"), 400, "not a recognised image"),
        (
            {**_image_input(1, len(_elements(PNG))), "outputs": [{"name": "LOGITS"}]},
            _elements(PNG),
            400,
            "unknown output",
        ),
        (
            {
                **_image_input(1, len(_elements(PNG))),
                "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 0}}],
            },
            _elements(PNG),
            400,
            "classification",
        ),
        (
            {
                **_image_input(1, len(_elements(PNG))),
                "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": True}}],
            },
            _elements(PNG),
            400,
            "classification",
        ),
        ({"inputs": "IMAGE"}, b"", 400, "one tensor"),
        ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "parameters": []}]}, b"", 400, "object"),
    ],
    ids=[
        "no-input",
        "wrong-name",
        "wrong-type",
        "json-not-base64",
        "shape-vs-data",
        "zero-images",
        "too-many",
        "bad-shape",
        "string-dim",
        "size-mismatch",
        "element-overruns",
        "cut-length",
        "not-an-image",
        "unknown-output",
        "classification-0",
        "classification-bool",
        "inputs-not-list",
        "parameters-not-object",
    ],
)
async def test_hostile_inference_requests_get_the_protocols_error(
    gateway_factory: MakeSettings, header: dict[str, Any], binary: bytes, status: int, words: str
) -> None:
    backend = FakeBackend()
    async with running_gateway(gateway_factory(backend="fake"), backend) as gateway:
        content, headers = _body(header, binary)
        response = await gateway.post("/v2/models/efficientnet-lite0/infer", content=content, headers=headers)
        good = await gateway.post(
            "/v2/models/efficientnet-lite0/infer",
            content=json.dumps(_image_input(1, data=[base64.b64encode(PNG).decode()])),
        )
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    assert words in response.json()["error"]
    assert good.status_code == 200  # and nothing else was lost
    assert good.json()["outputs"][0]["shape"] == [1, 1000]


@pytest.mark.parametrize(
    ("content", "headers", "words"),
    [
        (b"{not json", {}, "not JSON"),
        (b"[1, 2]", {}, "JSON object"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "99999"}, "within the body"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "-1"}, "within the body"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "\u0663".encode()}, "within the body"),
        (STRAY + b"trailing", {"Inference-Header-Content-Length": str(len(STRAY))}, "binary_data_size"),
        (b"\xff\xfe", {}, "not JSON"),
        # "²" (latin-1 on the wire) passes str.isdigit() and fails int(): it was a plain-text 500
        (b'{"inputs": []}', {"Inference-Header-Content-Length": b"\xb2"}, "within the body"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "9" * 5000}, "within the body"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "1" + "0" * 40}, "within the body"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, {}, "JSON values"),
        (
            json.dumps(_image_input(1))[:-3].encode() + b', "data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}",
            {},
            "JSON values",
        ),
        (b'{"inputs": [], "inputs": []}', {}, "duplicate key"),
        (b'{"inputs": NaN}', {}, "NaN is not JSON"),
        # echoed in the answer, it could not be encoded: a 500, after the image was computed
        (STRAY[:-1] + b', "id": "\\ud800"}', {}, "lone UTF-16 surrogate (\\ud800)"),
    ],
    ids=[
        "broken-json",
        "array",
        "header-too-long",
        "negative-length",
        "unicode-digit",
        "stray-bytes",
        "not-utf8",
        "superscript-digit",
        "5000-digits",
        "41-digits",
        "deep-header",
        "deep-data",
        "duplicate-key",
        "nan",
        "lone-surrogate-id",
    ],
)
async def test_a_broken_envelope_gets_400(
    gateway_factory: MakeSettings,
    content: bytes,
    headers: dict[str, str | bytes],
    words: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every malformed envelope (header length, JSON) is a 400 in the protocol's shape naming the
    fault, with nothing logged at error level (it was a plain-text 500 and a traceback for four)."""
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as gateway:
        response = await gateway.post("/v2/models/efficientnet-lite0/infer", content=content, headers=headers)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"}
    assert words in response.json()["error"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


TINY_ELEMENTS = 4_000_000
"""One 16 MiB body's worth of the smallest elements (it stalled the event loop 1.8-2.9 s)."""


@pytest.mark.parametrize("shape", [[1], [64]])
def test_millions_of_json_elements_are_refused_before_the_parse(
    monkeypatch: pytest.MonkeyPatch, shape: list[int]
) -> None:
    """A header of 4 million tiny ``data`` elements is refused (400, saying why) from a count of its
    separators, before the JSON parser builds an object for one of them, whatever the shape says."""
    parsed = []
    monkeypatch.setattr(strict_json, "loads", lambda *args, **kwargs: parsed.append(args))
    head = json.dumps(_image_input(shape[0]))[:-3].encode() + b', "data": [' + b"1," * TINY_ELEMENTS + b"1]}]}"
    with pytest.raises(BadRequest, match="holds over 384 JSON values"):
        parse_request(head, None, 64, 1000)
    assert parsed == []


@pytest.mark.parametrize(
    "id_", [",[{" * 10_000, ',\\"[' * 10_000 + "\\", '"], [' * 5_000], ids=["plain", "escapes", "quotes"]
)
def test_a_valid_request_is_not_refused_for_commas_inside_its_strings(id_: str) -> None:
    """The separator count is an upper bound that counts inside strings too; a request whose id is
    full of commas and brackets, escaped quotes and backslashes among them, is counted again without
    its strings and served."""
    header = {**_image_input(1, data=[base64.b64encode(PNG).decode()]), "id": id_}
    asked = parse_request(json.dumps(header).encode(), None, 64, 1000)
    assert [image.data for image in asked.images] == [PNG]
    assert asked.id == id_


def test_millions_of_json_strings_are_refused_without_taking_each_out() -> None:
    """Over the bound by separators, and made of strings: no more strings are stripped than the
    bound (a document of more strings holds too many values anyway)."""
    head = b'{"inputs": [{"data": [' + b'"",' * TINY_ELEMENTS + b'""]}]}'
    with pytest.raises(BadRequest, match="JSON values"):
        parse_request(head, None, 64, 1000)


def test_a_string_left_open_full_of_escaped_quotes_is_counted_in_linear_time() -> None:
    """Over the bound by separators, then a string never closed, made of 40 KB of escaped quotes:
    the count refuses it in milliseconds (the string pattern was tried again from every quote inside
    it, in quadratic time: this took 9 s holding the GIL, and a real gateway's /healthz waited as
    long; 16 MiB would have held it for days)."""
    head = b"," * 400 + b'"' + b'\\"' * 20_000
    started = time.perf_counter()
    with pytest.raises(BadRequest, match="JSON values"):
        parse_request(head, None, 64, 1000)
    assert time.perf_counter() - started < 1.0


def test_escaped_quotes_and_backslashes_in_strings_are_counted_as_strings() -> None:
    """Escaped quotes and backslashes end no string: a request whose id is full of them and of
    separators is counted without its strings and served."""
    tricky = '\\",[{\\' * 5_000
    header = {**_image_input(1, data=[base64.b64encode(PNG).decode()]), "id": tricky}
    asked = parse_request(json.dumps(header).encode(), None, 64, 1000)
    assert [image.data for image in asked.images] == [PNG]
    assert asked.id == tricky


def test_an_escaped_surrogate_pair_is_text() -> None:
    """A ``\\u`` surrogate pair (what ``json.dumps`` writes for an emoji) is one character, taken;
    only a lone surrogate is refused."""
    header = json.dumps({**_image_input(1, data=[base64.b64encode(PNG).decode()]), "id": "cat \U0001f431"})
    assert "\\ud83d\\udc31" in header
    assert parse_request(header.encode(), None, 64, 1000).id == "cat \U0001f431"


@pytest.mark.parametrize("where", ["header", "data"])
def test_nesting_deeper_than_the_parser_goes_is_a_400(where: str) -> None:
    """With an image limit whose value bound is over the interpreter's recursion limit, JSON nested
    deeper than the parser can go is a 400 (its RecursionError is not a ValueError: it was a 500)."""
    depth = 3000
    nest = b"[" * depth + b"]" * depth
    head = (
        b'{"a": ' + nest + b"}"
        if where == "header"
        else json.dumps(_image_input(1))[:-3].encode() + b', "data": ' + nest + b"}]}"
    )
    with pytest.raises(BadRequest, match="nested too deeply"):
        parse_request(head, None, 2000, 1000)


def test_binary_data_of_millions_of_elements_is_read_no_further_than_the_shape() -> None:
    """16 MiB of empty binary elements under shape [1]: refused after the first element, saying
    how much was left, instead of splitting all 4 million first."""
    binary = struct.pack("<I", 0) * TINY_ELEMENTS
    header = json.dumps(_image_input(1, len(binary))).encode()
    with pytest.raises(BadRequest, match=r"goes on after 1 elements \(15999996 bytes more\)"):
        parse_request(header + binary, str(len(header)), 64, 1000)


async def test_unknown_models_queries_and_limits(gateway_factory: MakeSettings) -> None:
    settings = gateway_factory(backend="fake", api_keys="k-1", max_body_bytes=4096)
    async with running_gateway(settings, FakeBackend()) as gateway:
        open_paths = [await gateway.get(path) for path in ("/v2/health/live", "/v2/health/ready")]
        assert [r.status_code for r in open_paths] == [200, 200]  # probes need no key
        assert (await gateway.get("/v2/models/efficientnet-lite0")).status_code == 401
        keyed = httpx.Headers({"X-API-Key": "k-1"})
        missing = await gateway.get("/v2/models/nope", headers=keyed)
        assert missing.status_code == 404
        assert missing.json() == {
            "error": "no model 'nope'; this gateway serves efficientnet-lite0",
        }
        query = await gateway.post(
            "/v2/models/efficientnet-lite0/infer?top_k=3",
            content=json.dumps(_image_input(1, data=[base64.b64encode(PNG).decode()])),
            headers=keyed,
        )
        assert query.status_code == 422
        assert "top_k" in query.json()["error"]
        # the version is named in the path only: as a query it was taken as known, then ignored by
        # the fast path, and version 1 answered a request for version 2
        version = await gateway.post(
            "/v2/models/efficientnet-lite0/infer?version=2",
            content=json.dumps(_image_input(1, data=[base64.b64encode(PNG).decode()])),
            headers=keyed,
        )
        assert version.status_code == 422, version.text
        assert version.json() == {"error": "unknown query parameter(s) ['version']; this route takes: none"}
        big = await gateway.post(
            "/v2/models/efficientnet-lite0/infer", content=b"{" + b" " * 5000 + b"}", headers=keyed
        )
        assert big.status_code == 413
        server = (await gateway.get("/v2", headers=keyed)).json()
        assert server["extensions"] == [
            "classification",
            "binary_tensor_data",
            "model_repository",
            "model_configuration",
            "statistics",
        ]


async def test_refusals_before_the_route_have_the_protocols_shape(gateway_factory: MakeSettings) -> None:
    """A missing API key and a body over the limit are refused by the gateway's edge, before any
    route: under /v2 in the protocol's shape, so that tritonclient shows the message (it read
    ``unauthorized`` alone); elsewhere in the gateway's own."""
    settings = gateway_factory(api_keys="alpha", max_body_bytes=4096)
    async with running_gateway(settings) as gateway:
        url = str(gateway.base_url)
        with pytest.raises(InferenceServerException, match="a valid API key is required") as caught:
            await ask(url, "get_model_metadata", "efficientnet-lite0")
        assert caught.value.status() == "401"
        big = await gateway.post(
            "/v2/models/efficientnet-lite0/infer", content=b"x" * 8192, headers={"x-api-key": "alpha"}
        )
        own = await gateway.post("/classify", content=b"x" * 8192, headers={"x-api-key": "alpha"})
    assert big.status_code == 413
    assert big.json() == {"error": "request body is 8192 bytes; the limit is 4096"}
    assert own.status_code == 413
    assert own.json()["error"] == "payload_too_large"


async def test_an_unknown_query_parameter_is_refused_on_every_protocol_route(gateway_factory: MakeSettings) -> None:
    """``?ready=true`` is not the index's body: refused (422, in the protocol's shape, naming it), as
    infer refuses one, rather than ignored."""
    async with running_gateway(gateway_factory()) as gateway:
        answers = [
            await gateway.post("/v2/repository/index", params={"ready": "true"}),
            await gateway.get("/v2/models/efficientnet-lite0/config", params={"x": "1"}),
            await gateway.get("/v2/models/efficientnet-lite0", params={"x": "1"}),
            await gateway.get("/v2/models/stats", params={"x": "1"}),
        ]
    assert [answer.status_code for answer in answers] == [422] * 4
    assert answers[0].json() == {"error": "unknown query parameter(s) ['ready']; this route takes: none"}
