"""Images by URL: fetched and classified, and the SSRF guard. Only loopback is reachable here, so
the tests that fetch allow-list one loopback address (127.0.0.2, where the image server listens)
and prove the guard refuses the rest: other loopback addresses, names resolving to them,
link-local metadata, redirects into them, oversize and slow bodies, non-image answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from service.settings import Settings
from service.ssrf import AddressRefused, GuardedResolver, parse_allowlist, refusal
from tests.conftest import CAT_CLASSES, running_gateway

SERVER_HOST = "127.0.0.2"
LIMIT = 256 * 1024


@pytest.fixture
async def image_server(cat_jpeg: bytes, coffee_jpeg: bytes) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.2 with the cases below; yields its base URL."""
    sock = socket.socket()
    sock.bind((SERVER_HOST, 0))
    port = sock.getsockname()[1]

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/jpeg"})
        await response.prepare(request)
        for _ in range(50):
            await response.write(b"\xff" * 100)
            await asyncio.sleep(0.1)
        return response

    async def streamed_big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "image/jpeg"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(LIMIT // 65536 + 4):
            await response.write(b"\0" * 65536)
        return response

    def redirect(to: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            raise web.HTTPFound(to)

        return handler

    def static(body: bytes, content_type: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type=content_type)

        return handler

    app = web.Application()
    app.router.add_get("/cat.jpg", static(cat_jpeg, "image/jpeg"))
    app.router.add_get("/coffee.jpg", static(coffee_jpeg, "image/jpeg"))
    app.router.add_get("/page.html", static(b"<html></html>", "text/html"))
    app.router.add_get("/big.jpg", static(b"\0" * (LIMIT + 1), "image/jpeg"))
    app.router.add_get("/streamed-big.jpg", streamed_big)
    app.router.add_get("/slow.jpg", slow)
    app.router.add_get("/into-loopback", redirect(f"http://127.0.0.1:{port}/cat.jpg"))
    app.router.add_get("/relative", redirect("/cat.jpg"))
    app.router.add_get("/loop", redirect("/loop"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://{SERVER_HOST}:{port}"
    finally:
        await runner.cleanup()


def settings_for(gateway_factory: Callable[..., Settings], **overrides: object) -> Settings:
    values: dict[str, object] = {
        "url_allow_http": True,
        "url_allowlist": f"{SERVER_HOST}/32",
        "url_max_bytes": LIMIT,
        "url_timeout": 1.0,
    }
    return gateway_factory(**{**values, **overrides})


async def by_url(client: httpx.AsyncClient, *urls: str) -> httpx.Response:
    return await client.post("/classify", json={"images": [{"url": url} for url in urls]})


async def test_images_by_url_are_fetched_and_classified(
    gateway_factory: Callable[..., Settings], image_server: str
) -> None:
    async with running_gateway(settings_for(gateway_factory)) as client:
        answer = await by_url(client, f"{image_server}/cat.jpg", f"{image_server}/relative")
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [r["filename"] for r in results] == [f"{image_server}/cat.jpg", f"{image_server}/cat.jpg"]
        assert results[0]["labels"][0]["index"] in CAT_CLASSES
        assert results[1]["labels"] == results[0]["labels"]


async def test_the_guard_refuses_every_address_that_is_not_public(
    gateway_factory: Callable[..., Settings], image_server: str
) -> None:
    port = image_server.rsplit(":", 1)[1]
    async with running_gateway(settings_for(gateway_factory)) as client:
        for url in (
            f"http://127.0.0.1:{port}/cat.jpg",  # loopback, not the allow-listed one
            f"http://localhost:{port}/cat.jpg",  # a name: checked where it is resolved
            f"http://[::1]:{port}/cat.jpg",
            f"http://[::ffff:127.0.0.1]:{port}/cat.jpg",  # IPv4-mapped IPv6
            "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
            "http://10.1.2.3/x.jpg",
            "http://[fd00:ec2::254]/x.jpg",
            f"{image_server}/into-loopback",  # an allowed host redirecting into a refused one
        ):
            answer = await by_url(client, url)
            assert answer.status_code == 403, (url, answer.text)
            assert answer.json()["error"] == "url_not_allowed"
        numeric = await by_url(client, "http://2130706433/x.jpg")  # 127.0.0.1 in disguise
        assert numeric.status_code == 400

    # without the allow-list, the image server itself is refused: it is loopback too
    async with running_gateway(settings_for(gateway_factory, url_allowlist="")) as client:
        answer = await by_url(client, f"{image_server}/cat.jpg")
        assert answer.status_code == 403
        assert "loopback" in answer.json()["detail"]


async def test_https_only_by_default(gateway_factory: Callable[..., Settings], image_server: str) -> None:
    async with running_gateway(settings_for(gateway_factory, url_allow_http=False)) as client:
        plain = await by_url(client, f"{image_server}/cat.jpg")
        assert plain.status_code == 403
        assert "only https" in plain.json()["detail"]
        assert (await by_url(client, "ftp://example.com/x.jpg")).status_code == 400
        assert (await by_url(client, "file:///etc/passwd")).status_code == 400


async def test_oversize_slow_and_wrong_answers_are_refused(
    gateway_factory: Callable[..., Settings], image_server: str
) -> None:
    async with running_gateway(settings_for(gateway_factory)) as client:
        cases = {
            "/big.jpg": (413, "payload_too_large", "limit"),
            "/streamed-big.jpg": (413, "payload_too_large", "limit"),
            "/slow.jpg": (400, "url_fetch_failed", "within 1 s"),
            "/page.html": (415, "unsupported_media_type", "text/html"),
            "/missing.jpg": (400, "url_fetch_failed", "answered 404"),
            "/loop": (400, "url_fetch_failed", "redirects"),
        }
        for path, (status, error, words) in cases.items():
            answer = await by_url(client, f"{image_server}/cat.jpg", f"{image_server}{path}")
            assert answer.status_code == status, (path, answer.text)
            body = answer.json()
            assert body["error"] == error
            assert words in body["detail"]
            assert body["detail"].startswith("image 2"), body["detail"]  # names the URL at fault
        assert (await by_url(client, f"{image_server}/cat.jpg")).status_code == 200  # nothing stuck


async def test_malformed_json_bodies_say_what_is_wrong(
    gateway_factory: Callable[..., Settings], image_server: str
) -> None:
    async with running_gateway(settings_for(gateway_factory, max_images_per_request=2)) as client:
        for body in ({"images": []}, {"images": [{"uri": "x"}]}, {"images": [{"url": "x"}], "extra": 1}, [1]):
            answer = await client.post("/classify", json=body)
            assert answer.status_code == 400, body
            assert answer.json()["detail"].startswith("JSON body:")
        broken = await client.post("/classify", content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 400
        too_many = await by_url(client, *[f"{image_server}/cat.jpg"] * 3)
        assert too_many.status_code == 400
        assert "at most 2" in too_many.json()["detail"]
    async with running_gateway(settings_for(gateway_factory, url_inputs=False)) as client:
        off = await by_url(client, f"{image_server}/cat.jpg")
        assert off.status_code == 415
        assert "turned off" in off.json()["detail"]


async def test_the_resolver_checks_the_addresses_it_hands_to_the_connection() -> None:
    """DNS rebinding: a name that answered a public address once and a private one next is refused
    on the answer the connection would use, not on an earlier lookup."""
    answers = iter([["93.184.216.34"], ["10.0.0.7"]])

    class Rebinding:
        async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
            return [
                {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
                for a in next(answers)
            ]

        async def close(self) -> None:
            pass

    resolver = GuardedResolver(parse_allowlist(""))
    resolver._resolver = Rebinding()  # type: ignore[assignment]
    assert (await resolver.resolve("images.example", 443))[0]["host"] == "93.184.216.34"
    with pytest.raises(AddressRefused, match=r"images\.example resolves to a private address"):
        await resolver.resolve("images.example", 443)


def test_refusal_reasons() -> None:
    import ipaddress

    allow = parse_allowlist("10.20.0.0/16")
    assert refusal(ipaddress.ip_address("10.20.1.1"), allow) is None
    assert refusal(ipaddress.ip_address("8.8.8.8"), allow) is None
    assert "private" in (refusal(ipaddress.ip_address("10.21.1.1"), allow) or "")
    assert "link-local" in (refusal(ipaddress.ip_address("169.254.169.254"), allow) or "")
    assert "not globally routable" in (refusal(ipaddress.ip_address("100.64.0.1"), allow) or "")
    assert refusal(ipaddress.ip_address("224.0.0.1"), allow) is not None


def test_refusal_judges_an_ipv6_address_by_the_ipv4_address_it_carries() -> None:
    """6to4, NAT64, IPv4-compatible, SIIT and IPv4-mapped addresses are judged by the IPv4 address
    inside (refused if it is, allowed if it is public or allow-listed); local-use NAT64, Teredo and
    site-local addresses are refused whatever they hold."""
    import ipaddress

    allow = parse_allowlist("10.20.0.0/16")

    def why(text: str) -> str | None:
        return refusal(ipaddress.ip_address(text), allow)

    for carrier in ("2002:{h}:{l}::1", "64:ff9b::{h}:{l}", "::{h}:{l}", "::ffff:0:{h}:{l}", "::ffff:{h}:{l}"):
        assert "127.0.0.1 is a loopback" in (why(carrier.format(h="7f00", l="1")) or ""), carrier
        assert "10.0.0.7 is a private" in (why(carrier.format(h="a00", l="7")) or ""), carrier
        assert "169.254.169.254 is a link-local" in (why(carrier.format(h="a9fe", l="a9fe")) or ""), carrier
        assert why(carrier.format(h="808", l="808")) is None, carrier  # 8.8.8.8
        assert why(carrier.format(h="a14", l="101")) is None, carrier  # 10.20.1.1: allow-listed
    assert "local-use NAT64" in (why("64:ff9b:1::808:808") or "")
    assert "Teredo" in (why("2001:0:4136:e378:8000:63bf:3fff:fdd2") or "")
    assert "site-local" in (why("fec0::1") or "")
    assert "loopback" in (why("::1") or "")
    assert why("::") is not None
    assert why("2606:4700::1111") is None  # a public IPv6 address
