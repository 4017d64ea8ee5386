"""Hostile input on the URL surface: image URLs (JSON bodies), the redirects they lead to, and
``Webhook-URL`` (at submit, and in a delivery message that did not come through the API).

The targets are loopback servers that must never see a connection: a ``Trap`` counts every
connection it accepts, and each test asserts the count stays 0. The one host the guard allows
(127.0.0.2, allow-listed, standing in for a public image host) redirects wherever a test asks."""

from __future__ import annotations

import asyncio
import base64
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from urllib.parse import quote

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from yarl import URL

from service.errors import GatewayError
from service.http.fetch import _redirect_target
from service.jobs.broker import Broker
from service.jobs.messages import DETAIL_HEADER, JobResult
from service.jobs.topology import Names
from service.jobs.webhooks import WebhookSender, delivery_message
from service.metrics import Metrics
from service.settings import Settings
from service.ssrf import parse_url
from tests.conftest import png_bytes, running_gateway, solid_image
from tests.jobs.conftest import BROKER_URL, _delete_everything, drain, queue_depth

MakeSettings = Callable[..., Settings]
TRAP_HOST = "127.0.0.1"
ALLOWED_HOST = "127.0.0.2"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
UNICODE_DOTS = ("\u3002", "\uff0e", "\uff61")  # ideographic, fullwidth and halfwidth ideographic full stops


class Trap:
    """A TCP server that counts the connections it accepts and closes each at once."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0

    async def on_connection(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        writer.close()


@asynccontextmanager
async def trap(host: str = TRAP_HOST) -> AsyncIterator[Trap]:
    caught = Trap()
    server = await asyncio.start_server(caught.on_connection, host, 0)
    caught.port = server.sockets[0].getsockname()[1]
    async with server:
        yield caught


@asynccontextmanager
async def allowed_host() -> AsyncIterator[str]:
    """An HTTP server on the allow-listed address: ``/to?location=L`` answers 302 to ``L``, ``/long``
    to a URL of 3,000 characters."""

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": request.query["location"]})

    async def long(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "http://a.example/" + "x" * 3000})

    app = web.Application()
    app.router.add_get("/to", redirect)
    app.router.add_get("/long", long)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, ALLOWED_HOST, 0)
    await site.start()
    try:
        yield f"http://{ALLOWED_HOST}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def fetching(make: MakeSettings, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "url_allow_http": True,
        "url_allowlist": f"{ALLOWED_HOST}/32",
        "url_timeout": 1.0,
    }
    return make(**{**values, **overrides})


async def by_url(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post("/classify", json={"images": [{"url": url}]})


def with_unicode_dots(host: str) -> list[str]:
    """``host`` written with each of the full stops that IDNA maps to ".", and with them mixed."""
    forms = [host.replace(".", dot) for dot in UNICODE_DOTS]
    labels = host.split(".")
    forms.append("".join(label + UNICODE_DOTS[i % 3] for i, label in enumerate(labels[:-1])) + labels[-1])
    return forms


def translation_forms(v4: str) -> dict[str, str]:
    """IPv6 literals (for a URL, in brackets) that carry or stand for the IPv4 address ``v4``."""
    a, b, c, d = (int(x) for x in v4.split("."))
    high, low = f"{a:02x}{b:02x}", f"{c:02x}{d:02x}"
    inverted = f"{a ^ 0xFF:02x}{b ^ 0xFF:02x}:{c ^ 0xFF:02x}{d ^ 0xFF:02x}"
    return {
        "IPv4-mapped": f"[::ffff:{v4}]",
        "IPv4-compatible": f"[::{v4}]",
        "SIIT": f"[::ffff:0:{v4}]",
        "NAT64": f"[64:ff9b::{v4}]",
        "local-use NAT64": f"[64:ff9b:1::{high}:{low}]",
        "6to4": f"[2002:{high}:{low}::1]",
        "Teredo": f"[2001:0:4136:e378:8000:63bf:{inverted}]",
    }


async def test_unicode_full_stops_never_reach_an_internal_address(gateway_factory: MakeSettings) -> None:
    """``http://127。0。0。1:PORT/`` (and the other full stops IDNA maps to ".") is the loopback
    address to the HTTP client: refused as loopback, 403, and the server there sees no connection,
    whether the URL is given or is where an allowed host redirects to."""
    async with trap() as caught, allowed_host() as public, running_gateway(fetching(gateway_factory)) as client:
        for host in with_unicode_dots(TRAP_HOST):
            url = f"http://{host}:{caught.port}/x.jpg"
            for given in (url, f"{public}/to?location={url}"):
                answer = await by_url(client, given)
                assert answer.status_code == 403, (given, answer.text)
                assert answer.json()["error"] == "url_not_allowed"
                assert "127.0.0.1 is a loopback address" in answer.json()["detail"]
        assert caught.accepted == 0


async def test_a_refused_https_port_reads_the_same_open_or_closed(gateway_factory: MakeSettings) -> None:
    """https only (the default): an internal TLS port is not probed; the answer for a refused
    address is the same, word for word, whether anything listens there or not (no connection is
    attempted)."""
    closed = socket.socket()
    closed.bind((TRAP_HOST, 0))  # bound, never listening: connections to it are refused
    closed_port = closed.getsockname()[1]
    try:
        async with trap() as caught, running_gateway(fetching(gateway_factory, url_allow_http=False)) as client:
            for host in (*with_unicode_dots(TRAP_HOST), TRAP_HOST, "[::ffff:127.0.0.1]"):
                answers = []
                for port in (caught.port, closed_port):
                    answer = await by_url(client, f"https://{host}:{port}/x.jpg")
                    answers.append((answer.status_code, answer.json()["detail"].replace(str(port), "PORT")))
                assert answers[0] == answers[1], answers
                assert answers[0][0] == 403, answers
        assert caught.accepted == 0
    finally:
        closed.close()


async def test_address_translation_forms_are_not_public(gateway_factory: MakeSettings) -> None:
    """Every IPv6 form that carries an IPv4 address (or whose embedding the operator chooses) is
    judged by what it carries: loopback and private IPv4 inside 6to4, NAT64, IPv4-compatible,
    SIIT, Teredo and IPv4-mapped addresses are refused (403), as is site-local fec0::/10; given
    directly or as a redirect's target."""
    async with trap() as caught, allowed_host() as public, running_gateway(fetching(gateway_factory)) as client:
        for v4 in (TRAP_HOST, "10.1.2.3"):
            for form, host in {**translation_forms(v4), "site-local": "[fec0::1]"}.items():
                url = f"http://{host}:{caught.port}/x.jpg"
                for given in (url, f"{public}/to?location={url}"):
                    answer = await by_url(client, given)
                    assert answer.status_code == 403, (form, given, answer.text)
                    assert answer.json()["error"] == "url_not_allowed"
        assert caught.accepted == 0


MALFORMED = {
    "http://a..b/x.jpg": "empty label",
    "http://.a.example/x.jpg": "empty label",
    f"http://{'a' * 64}.example/x.jpg": "63",
    f"http://{'a' * 60 + '.'}{'b' * 60 + '.'}{'c' * 60 + '.'}{'d' * 60 + '.'}{'e' * 10}.example/x.jpg": "253",
    "https://[::1": "not a valid URL",
    "http://[1.2.3.4]/x.jpg": "not a valid URL",
    "http://a[:]@": "not a valid URL",  # yarl raises IndexError on it
    "http://u[:]@/x.jpg": "not a valid URL",
    "http://[v1.x]/x.jpg": "IPv6",  # IPvFuture: yarl would request the name v1.x
    "http://a.example:99999/x.jpg": "not a valid URL",
    "http://a.example:-1/x.jpg": "not a valid URL",
    "http://[fe80::1%25eth0]/x.jpg": "zone",
    "http://a\x00b.example/x.jpg": "control character",
    "http://a.example/x\x7f.jpg": "control character",
    "http://a\r\nb.example/x.jpg": "control character",
    "http://a\\b.example/x.jpg": "not a valid URL",
    "http://a b.example/x.jpg": "not a valid host name",
    "http://a%2eb.example/x.jpg": "not a valid host name",
    "http://xn--/x.jpg": "not a valid URL",
    "http://xn--a/x.jpg": "not a valid URL",
    "http://user@a.example/x.jpg": "credentials",
    "http:///x.jpg": "no host",
    "http://2130706433/x.jpg": "canonical",
    "http://127.1/x.jpg": "canonical",
    "http://0x7f.0.0.1/x.jpg": "canonical",
    "http://127.0.0.1./x.jpg": "canonical",
    "http://a.example/" + "x" * 10_000: "at most 2048",
}


async def test_malformed_image_urls_are_400s_saying_what_is_wrong(gateway_factory: MakeSettings) -> None:
    """Each malformed URL, given or redirected to, is a 400 ``bad_request`` whose detail names the
    fault (never a 500); no connection is made anywhere."""
    async with trap() as caught, allowed_host() as public, running_gateway(fetching(gateway_factory)) as client:
        for url, words in MALFORMED.items():
            answer = await by_url(client, url)
            assert answer.status_code == 400, (url, answer.text)
            assert answer.json()["error"] == "bad_request", (url, answer.text)
            assert words in answer.json()["detail"], (url, answer.text)
        redirected = (
            "http://a..b/x.jpg",
            "https://[::1",
            f"http://{'a' * 64}.example/x.jpg",
            "http://xn--a/x.jpg",
            "http://a[:]@",
        )
        for given in (*(f"{public}/to?location={quote(url)}" for url in redirected), f"{public}/long"):
            answer = await by_url(client, given)
            assert answer.status_code == 400, (given, answer.text)
            assert "redirected to" in answer.json()["detail"], answer.text
        assert caught.accepted == 0


@asynccontextmanager
async def raw_redirect_host(location: bytes) -> AsyncIterator[str]:
    """An image host on the allow-listed address that answers every request with a 302 whose
    Location is ``location``, byte for byte (an HTTP library would refuse to send such bytes)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 302 Found\r\nLocation: " + location + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, ALLOWED_HOST, 0)
    async with server:
        yield f"http://{ALLOWED_HOST}:{server.sockets[0].getsockname()[1]}/x.jpg"


@pytest.mark.parametrize("location", [b"http://[::1\xff", b"http://[v1.\xff]/", b"http://a\xff\xfe..b/x.jpg"])
async def test_a_location_of_raw_bytes_is_a_400_in_json(gateway_factory: MakeSettings, location: bytes) -> None:
    """A redirect to bytes that are not text (decoded with surrogates by the HTTP client) is a 400
    whose JSON detail shows them escaped: quoting them as they were made the answer a 500."""
    async with raw_redirect_host(location) as given, running_gateway(fetching(gateway_factory)) as client:
        answer = await by_url(client, given)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "bad_request"
    assert "redirected to" in answer.json()["detail"]
    assert "\\udcff" in answer.json()["detail"]


@asynccontextmanager
async def delivered(settings: Settings, names: Names, urls: dict[str, str]) -> AsyncIterator[WebhookSender]:
    """A webhook sender given a delivery message per ``urls`` entry (job id: URL), yielded once as
    many dead letters are queued; stopped (what is in progress settled) and its broker closed after."""
    broker = Broker(BROKER_URL, names)
    await broker.connect(timeout=10)
    sender = WebhookSender(settings, broker, Metrics())
    await sender.start()
    try:
        for job_id, url in urls.items():
            await broker.publish(
                "queue", delivery_message(JobResult(job_id=job_id, status="done"), url), names.webhooks
            )
        async with asyncio.timeout(30):
            while await queue_depth(names.dead) < len(urls):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        yield sender
    finally:
        await sender.stop(drain_timeout=2)
        await broker.aclose()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh queue prefix on the shared RabbitMQ for one test, deleted after it."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    asyncio.run(_delete_everything(name))


@pytest.mark.rabbitmq
async def test_webhook_urls_of_the_same_forms_are_refused_at_submit(gateway_factory: MakeSettings, prefix: str) -> None:
    """``Webhook-URL`` with Unicode full stops or an address-translation form of a loopback or
    private address is 403 at submit; a malformed one (or one with non-ASCII bytes) is 400 with
    what was wrong; nothing is queued, nothing connected to."""
    settings = gateway_factory(
        broker_url=BROKER_URL, queue_prefix=prefix, backend="fake", webhook_secret=SECRET, webhook_allow_http=True
    )
    image = [("file", ("a.png", png_bytes(solid_image(5, 16)), "image/png"))]

    async def submit(client: httpx.AsyncClient, url: str | bytes) -> httpx.Response:
        return await client.post("/classify?mode=offline", files=image, headers={"Webhook-URL": url})

    async with trap() as caught, running_gateway(settings) as client:
        refused: list[str | bytes] = []
        for host in with_unicode_dots(TRAP_HOST):  # a header carries them only as (UTF-8) bytes
            refused.append(f"http://{host}:{caught.port}/hook".encode())
        for v4 in (TRAP_HOST, "10.1.2.3"):
            refused += [f"http://{host}:{caught.port}/hook" for host in translation_forms(v4).values()]
        refused.append("http://[fec0::1]/hook")
        for url in refused:
            answer = await submit(client, url)
            if isinstance(url, bytes):
                assert answer.status_code == 400, (url, answer.text)
                assert "ASCII" in answer.json()["detail"], answer.text
                continue
            assert answer.status_code == 403, (url, answer.text)
            assert answer.json()["error"] == "url_not_allowed"
            assert answer.json()["detail"].startswith("Webhook-URL")
        malformed: dict[str | bytes, str] = {
            url: words
            for url, words in MALFORMED.items()
            if len(url) < 2048 and not any(ord(c) < 32 or ord(c) == 127 for c in url)  # a header cannot carry them
        }
        malformed["http://h\xc3\xa9.example/hook".encode("latin-1")] = "ASCII"  # é as UTF-8 bytes
        for raw, words in malformed.items():
            answer = await submit(client, raw)
            assert answer.status_code == 400, (raw, answer.text)
            assert answer.json()["error"] == "bad_request", (raw, answer.text)
            assert words in answer.json()["detail"], (raw, answer.text)
        assert caught.accepted == 0
    assert await queue_depth(Names(prefix).work) == 0


@pytest.mark.rabbitmq
async def test_the_webhook_sender_refuses_those_forms_where_it_connects(
    gateway_factory: MakeSettings, prefix: str
) -> None:
    """A delivery message (it need not have come through the API) whose URL writes a loopback
    address with Unicode full stops, or in an address-translation form, or is malformed, is
    dead-lettered as undeliverable with the guard's reason; the server there sees no connection."""
    names = Names(prefix)
    settings = gateway_factory(
        broker_url=BROKER_URL,
        queue_prefix=prefix,
        webhook_secret=SECRET,
        webhook_allow_http=True,
        webhook_retry_delays="0.1",
        webhook_max_age=1.0,
    )
    async with trap() as caught:
        urls = {
            **{f"dots-{i}": f"http://{h}:{caught.port}/hook" for i, h in enumerate(with_unicode_dots(TRAP_HOST))},
            "nat64": f"http://[64:ff9b::{TRAP_HOST}]:{caught.port}/hook",
            "6to4": f"http://[2002:7f00:1::1]:{caught.port}/hook",
            "malformed": "http://a..b/hook",
        }
        async with delivered(settings, names, urls):
            dead = {m.message_id: str((m.headers or {})[DETAIL_HEADER]) for m in await drain(names.dead)}
        assert caught.accepted == 0
    for job_id in urls:
        reason = dead[job_id]
        assert "loopback" in reason or "empty label" in reason, (job_id, reason)


@pytest.mark.rabbitmq
async def test_a_refused_name_does_not_tell_what_it_resolves_to(gateway_factory: MakeSettings, prefix: str) -> None:
    """A name that resolves to a refused address (``localhost`` here; ``db.internal`` in a cluster)
    is 403 naming the host and the kind of address, never the address: the gateway's answers are
    no oracle of its internal DNS. Given, redirected to, or as a ``Webhook-URL``."""
    settings = fetching(
        gateway_factory,
        broker_url=BROKER_URL,
        queue_prefix=prefix,
        backend="fake",
        webhook_secret=SECRET,
        webhook_allow_http=True,
    )
    image = [("file", ("a.png", png_bytes(solid_image(5, 16)), "image/png"))]
    async with trap() as caught, allowed_host() as public, running_gateway(settings) as client:
        url = f"http://localhost:{caught.port}/x.jpg"
        answers = [await by_url(client, url), await by_url(client, f"{public}/to?location={quote(url)}")]
        answers.append(await client.post("/classify?mode=offline", files=image, headers={"Webhook-URL": url}))
        for answer in answers:
            assert answer.status_code == 403, answer.text
            detail = answer.json()["detail"]
            assert "localhost resolves to a loopback address" in detail, detail
            assert "127.0.0.1" not in detail, detail
            assert "::1" not in detail, detail
        assert caught.accepted == 0


@pytest.mark.rabbitmq
async def test_a_malformed_webhook_url_is_dead_lettered_once(gateway_factory: MakeSettings, prefix: str) -> None:
    """A delivery whose URL no parser can split (``https://[::1``) is dead-lettered once and acked:
    logging where it was going must not fail after the dead letter is out, which requeued the
    delivery to be dead-lettered again, over and over."""
    names = Names(prefix)
    settings = gateway_factory(broker_url=BROKER_URL, queue_prefix=prefix, webhook_secret=SECRET)
    urls = {"unclosed": "https://[::1/hook?token=secret", "yarl": "http://a[:]@"}
    async with delivered(settings, names, urls) as sender:
        pass  # leaving settles what is in progress: a requeue would be back in the queue
    assert await queue_depth(names.webhooks) == 0
    dead = await drain(names.dead)
    assert sorted(m.message_id or "" for m in dead) == sorted(urls)
    assert sender.metrics.webhook_deliveries.labels("undeliverable")._value.get() == len(urls)


URL_PIECES = st.sampled_from(
    [
        *"hts:/[]@%.-0129afvx?#\\ ",
        "\u3002",
        "\uff0e",
        "\u2024",
        "\u200b",
        "\ud800",
        "\udcff",
        "\x00",
        "\n",
        "ß",
        "\uff11",  # fullwidth 1
        "\u210c",  # black-letter H
        "İ",
    ]
)


@settings(max_examples=3000, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.text(URL_PIECES, max_size=30).map(lambda s: "http://" + s),
        st.text(URL_PIECES, max_size=30).map(lambda s: "//" + s),
        st.text(URL_PIECES, max_size=30),
        st.text(max_size=40).map(lambda s: "https://" + s),
    )
)
@example("http://a[:]@")
def test_url_text_is_taken_or_refused_never_an_exception(text: str) -> None:
    """Any text, as an image or webhook URL or as a redirect's Location, is either a URL the
    guard takes or its 400/403: never another exception (a 500)."""
    for allow_http in (True, False):
        for url in (text, _redirect_target(URL("http://127.0.0.2:8080/to?x=1"), text)):
            try:
                parse_url(url, "image", allow_http)
            except GatewayError as exc:
                status = exc.status_code
            else:
                status = 200
            assert status in (200, 400, 403), (url, status)
