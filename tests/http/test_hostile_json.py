"""Hostile JSON bodies (images by URL) sent to a real uvicorn running the gateway: a body is
bounded in bytes before it is parsed, counted before its entries are validated, and anything
malformed is a clear 400 or 413 in the gateway's JSON error shape, never a 500 or a stall."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.backends.fake import FakeBackend
from service.errors import BadRequest
from service.http import json_body, strict_json
from service.schemas import MAX_URL_LENGTH
from service.settings import Settings
from tests.conftest import running_gateway

MakeSettings = Callable[..., Settings]
JSON = {"content-type": "application/json"}
REFUSED_URL = "https://127.0.0.1/x.jpg"
"""A well-formed URL the SSRF guard refuses (403) without any fetch: a body that gets this far
was read and parsed whole."""


def _error(answer: httpx.Response, status: int, error: str, words: str) -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["error"] == error
    assert words in body["detail"], body["detail"]
    assert body["request_id"]


async def test_a_large_body_of_tiny_entries_is_refused_before_parsing(gateway_factory: MakeSettings) -> None:
    """16 MiB of {"url": "a"} entries (1.4 million, just under GATEWAY_MAX_BODY_BYTES): 413 from
    Content-Length, naming the setting, before any of it is parsed (it was parsed whole first:
    +786 MiB and a 4.5 s stall)."""
    body = b'{"images":[' + b",".join([b'{"url":"a"}'] * 1_398_000) + b"]}"
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        answer = await client.post("/classify", content=body, headers=JSON)
        _error(answer, 413, "payload_too_large", "GATEWAY_MAX_JSON_BODY_BYTES")
        assert (await client.get("/healthz")).status_code == 200


async def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_bound(gateway_factory: MakeSettings) -> None:
    """A chunked JSON body without Content-Length: 413 as soon as the bytes received pass the
    bound, while the client is still sending (not after reading the whole body)."""
    settings = gateway_factory(backend="fake", max_json_body_bytes=4096)
    async with running_gateway(settings, FakeBackend()) as client:
        assert client.base_url.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
        writer.write(
            b"POST /classify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b'{"images":[' + b'{"url":"a"},' * 400  # 4,811 bytes: past the bound; the body is never finished
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413")
        writer.close()


async def test_many_entries_within_the_bound_are_counted_before_validation(gateway_factory: MakeSettings) -> None:
    """40,000 empty entries (120 KB, within the byte bound): refused for their number with a short
    answer, not validated one by one into 40,000 errors."""
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        answer = await client.post(
            "/classify", content=b'{"images":[' + b",".join([b"{}"] * 40_000) + b"]}", headers=JSON
        )
        _error(answer, 400, "bad_request", "40000 images; at most 64")
        assert len(answer.content) < 1000


async def test_the_largest_valid_body_fits_the_default_bound(gateway_factory: MakeSettings) -> None:
    """max_images_per_request URLs of the longest length, indented: within the default bound, read
    and parsed (the guard then refuses the address: 403)."""
    url = REFUSED_URL + "?" + "a" * (MAX_URL_LENGTH - len(REFUSED_URL) - 1)
    settings = gateway_factory(backend="fake")
    body = json.dumps({"images": [{"url": url}] * settings.max_images_per_request}, indent=4).encode()
    assert len(body) > 128 * 1024
    async with running_gateway(settings, FakeBackend()) as client:
        answer = await client.post("/classify", content=body, headers=JSON)
        assert answer.status_code == 403, answer.text


BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("deep", b'{"images":' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "JSON body"),
    ("deep-objects", b'{"images":[' + b'{"url":' * 10_000 + b'"a"' + b"}" * 10_000 + b"]}", 400, "JSON body"),
    ("duplicate-key", b'{"images":[{"url":"https://a.example/x.jpg"}],"images":[]}', 400, "duplicate key 'images'"),
    (
        "duplicate-url",
        b'{"images":[{"url":"https://a.example/x.jpg","url":"https://127.0.0.1/"}]}',
        400,
        "duplicate key",
    ),
    ("nan", b'{"images":[{"url":NaN}]}', 400, "NaN"),
    ("infinity", b'{"images":[{"url":"https://a.example/x.jpg"}],"n":-Infinity}', 400, "Infinity"),
    ("not-utf8", b'{"images":[{"url":"https://a.example/\xff\xfe.jpg"}]}', 400, "not UTF-8"),
    ("utf16", '{"images":[{"url":"https://a.example/x.jpg"}]}'.encode("utf-16"), 400, "not UTF-8"),
    ("lone-surrogate", b'{"images":[{"url":"https://a.example/\\ud800.jpg"}]}', 400, "lone UTF-16 surrogate"),
    ("url-number", b'{"images":[{"url":5}]}', 400, "images.0.url"),
    ("images-string", b'{"images":"https://a.example/x.jpg"}', 400, "images"),
    ("images-object", b'{"images":{"url":"https://a.example/x.jpg"}}', 400, "images"),
    ("top-level-list", b'[{"url":"https://a.example/x.jpg"}]', 400, "JSON body"),
    ("null", b"null", 400, "JSON body"),
    ("empty", b"", 400, "JSON body"),
    ("trailing", b'{"images":[{"url":"https://a.example/x.jpg"}]} x', 400, "JSON body"),
    ("extra-key", b'{"images":[{"url":"https://a.example/x.jpg","why":1}]}', 400, "images.0.why"),
    ("long-url", b'{"images":[{"url":"https://a.example/' + b"a" * 5000 + b'"}]}', 400, "at most 2048"),
    ("ten-mb-url", b'{"images":[{"url":"https://a.example/' + b"a" * 10_000_000 + b'"}]}', 413, "JSON body is over"),
]


@pytest.mark.parametrize(("body", "status", "words"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
async def test_malformed_bodies_are_clear_errors(
    gateway_factory: MakeSettings, body: bytes, status: int, words: str
) -> None:
    """Deep nesting, duplicate keys, NaN and Infinity, bytes that are not UTF-8, a lone surrogate,
    wrong types and shapes, extra keys, an over-long URL, a 10 MB URL: each a 400 or 413 in the
    gateway's error shape saying what is wrong; the gateway goes on serving."""
    async with running_gateway(gateway_factory(backend="fake"), FakeBackend()) as client:
        answer = await client.post("/classify", content=body, headers=JSON)
        _error(answer, status, "payload_too_large" if status == 413 else "bad_request", words)
        assert len(answer.content) < 2000
        assert (await client.post("/classify", json={"images": [{"url": REFUSED_URL}]})).status_code == 403


@pytest.mark.parametrize(
    "tail", [b"]}", b'],"x":[' + b",".join([b"{}"] * 30_000) + b"]}"], ids=["as-images", "under-another-key"]
)
def test_a_body_of_many_objects_makes_no_python_call_per_object(monkeypatch: pytest.MonkeyPatch, tail: bytes) -> None:
    """30,000 empty objects within the byte bound, as image entries or under an extra key: refused
    (400) by the C decoder's parse, the count and the schema, without the duplicate-key hook being
    called per object (that call was 5x the parse's cost, paid for every object of every body)."""
    calls = 0
    unique_keys = strict_json._unique_keys

    def counted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return unique_keys(pairs)

    monkeypatch.setattr(strict_json, "_unique_keys", counted)
    head = b'{"images":[' + (b",".join([b"{}"] * 30_000) if tail == b"]}" else b'{"url":"https://a.example/x.jpg"}')
    with pytest.raises(BadRequest):
        json_body.parse_urls(head + tail, 64)
    assert calls == 0
