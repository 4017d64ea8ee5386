"""Images given by URL (``{"images": [{"url": ...}]}``), fetched by the gateway with an SSRF guard.

* **Scheme**: https only unless ``GATEWAY_URL_ALLOW_HTTP``.
* **Addresses**: only globally routable ones; private, loopback, link-local (cloud metadata at
  169.254.169.254 included), shared, reserved and multicast addresses are refused unless a network
  of ``GATEWAY_URL_ALLOWLIST`` holds them. A host name is checked where it is resolved for the
  connection itself (the connector's resolver, ``GuardedResolver``): the address checked is the
  address connected to, so a name that answers a public address first and a private one next (DNS
  rebinding) gains nothing. An address written in the URL never reaches a resolver, so it is
  checked before the request.
* **Redirects** are followed by hand (at most ``GATEWAY_URL_MAX_REDIRECTS``), each hop checked the
  same way.
* **Size, time, type**: a body over ``GATEWAY_URL_MAX_BYTES`` is refused (from Content-Length, or
  as soon as the stream passes it), the whole fetch has ``GATEWAY_URL_TIMEOUT`` (a slow body
  included), and the answer must say ``image/*`` (or ``application/octet-stream``).
* **Memory**: bytes fetched by all requests in progress count against one bound
  (``max_buffered_body_bytes``, the uploads' bound), held until the request is answered; past it,
  429.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from service.classifier import ImageInput
from service.errors import (
    BadRequest,
    GatewayError,
    PayloadTooLarge,
    QueueFull,
    UnsupportedMediaType,
    UrlFetchFailed,
    UrlNotAllowed,
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
REDIRECTS = frozenset({301, 302, 303, 307, 308})
RESOLVE_TIMEOUT = 5.0


def parse_allowlist(text: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())


def refusal(address: Address, allowlist: Sequence[Network]) -> str | None:
    """Why the gateway must not connect to ``address`` (None: it may)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in allowlist):
        return None
    if address.is_multicast or not address.is_global:
        kind = (
            "loopback"
            if address.is_loopback
            else "link-local"
            if address.is_link_local
            else "private"
            if address.is_private
            else "not globally routable"
        )
        return f"{address} is a {kind} address"
    return None


def check_url(url: str, where: str, allow_http: bool, allowlist: Sequence[Network]) -> str:
    """``url`` if its scheme is allowed and its host, when an address, is one the guard allows (a
    host name is checked where it is resolved, by ``GuardedResolver``); ``where`` starts each error."""
    parts = urlsplit(url)
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        raise (BadRequest if parts.scheme not in ("http", "https") else UrlNotAllowed)(
            f"{where}: scheme {parts.scheme or 'missing'!r}; only {' and '.join(schemes)} URLs are allowed"
        )
    if not parts.hostname:
        raise BadRequest(f"{where}: no host in {url!r}")
    if parts.username or parts.password:
        raise BadRequest(f"{where}: credentials in the URL are not accepted")
    try:
        literal: Address | None = ipaddress.ip_address(parts.hostname)
    except ValueError:
        literal = None
        if parts.hostname.replace(".", "").isdigit() or parts.hostname.startswith("0x"):
            raise BadRequest(f"{where}: {parts.hostname!r} is not a canonical address") from None
    if literal is not None and (why := refusal(literal, allowlist)) is not None:
        raise UrlNotAllowed(f"{where}: {why}; the gateway does not connect to it")
    return url


async def check_destination(url: str, where: str, allow_http: bool, allowlist: Sequence[Network]) -> str:
    """``check_url``, and the host name resolved now, every address it has checked: for a URL the
    gateway will connect to later (a webhook), so that a refusal is an answer to the request that
    gave it. The connection checks again (the name may resolve elsewhere by then)."""
    check_url(url, where, allow_http, allowlist)
    host = urlsplit(url).hostname or ""
    resolver = GuardedResolver(allowlist)
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT):
            await resolver.resolve(host, 0, socket.AF_UNSPEC)
    except UrlNotAllowed as exc:
        raise UrlNotAllowed(f"{where}: {exc.detail}") from None
    except (OSError, TimeoutError):
        raise BadRequest(f"{where}: the host {host!r} cannot be resolved") from None
    finally:
        await resolver.close()
    return url


class GuardedResolver(AbstractResolver):
    """The system resolver, answering only addresses the guard allows (and refusing a name with any
    other: one name, one verdict)."""

    def __init__(self, allowlist: Sequence[Network]) -> None:
        self.allowlist = tuple(allowlist)
        self._resolver = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._resolver.resolve(host, port, family)
        for result in results:
            why = refusal(ipaddress.ip_address(result["host"]), self.allowlist)
            if why is not None:
                raise UrlNotAllowed(f"{host} resolves to an address the gateway does not connect to: {why}")
        return results

    async def close(self) -> None:
        await self._resolver.close()


def guarded_session(
    allowlist: Sequence[Network], *, timeout: float, limit: int, headers: dict[str, str]
) -> aiohttp.ClientSession:
    """An HTTP client that connects only to addresses the guard allows (checked where each name is
    resolved), with a total ``timeout`` per request, at most ``limit`` connections (an eighth of
    them per host: one slow host must not hold them all), and no decompression (a size cap is on
    the bytes received, never on what they inflate to)."""
    connector = aiohttp.TCPConnector(
        resolver=GuardedResolver(allowlist), use_dns_cache=False, limit=limit, limit_per_host=max(1, limit // 8)
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout),
        auto_decompress=False,
        headers=headers,
    )


class Fetcher:
    def __init__(
        self,
        *,
        allow_http: bool,
        allowlist: Sequence[Network],
        max_bytes: int,
        timeout: float,
        max_redirects: int,
        max_buffered_bytes: int,
        max_parallel: int = 64,
    ) -> None:
        self.allow_http = allow_http
        self.allowlist = tuple(allowlist)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        """Bytes fetched by the requests being handled now."""
        self._max_parallel = max_parallel
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = guarded_session(
                self.allowlist,
                timeout=self.timeout,
                limit=self._max_parallel,
                headers={"User-Agent": "inference-gateway (image fetch)", "Accept": "image/*"},
            )
        return self._session

    @contextlib.asynccontextmanager
    async def images(self, urls: Sequence[str]) -> AsyncIterator[list[ImageInput]]:
        """Fetch every URL at once; the bytes count as buffered until the block ends."""
        held = [0]
        try:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self._fetch(url, i, len(urls), held)) for i, url in enumerate(urls)]
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None
            yield [task.result() for task in tasks]
        finally:
            self.buffered -= held[0]

    async def _fetch(self, url: str, index: int, count: int, held: list[int]) -> ImageInput:
        where = origin = f"image {index + 1} ({url[:200]})" if count > 1 else url[:200]
        try:
            for _ in range(self.max_redirects + 1):
                checked = check_url(url, where, self.allow_http, self.allowlist)
                async with self._client().get(checked, allow_redirects=False) as response:
                    if response.status in REDIRECTS and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        where = f"{origin}, redirected to {url[:200]}"
                        continue
                    return await self._read(response, url, where, held)
            raise UrlFetchFailed(f"{where}: more than {self.max_redirects} redirects")
        except GatewayError:
            raise
        except TimeoutError:
            raise UrlFetchFailed(f"{where}: no complete answer within {self.timeout:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.__cause__, GatewayError):
                raise exc.__cause__ from None
            raise UrlFetchFailed(f"{where}: cannot connect ({exc.os_error.strerror or exc})") from None
        except aiohttp.ClientError as exc:
            raise UrlFetchFailed(f"{where}: {type(exc).__name__}: {exc}") from None

    async def _read(self, response: aiohttp.ClientResponse, url: str, where: str, held: list[int]) -> ImageInput:
        if response.status != 200:
            raise UrlFetchFailed(f"{where}: the server answered {response.status}")
        media = (response.content_type or "").lower()
        if not (media.startswith("image/") or media == "application/octet-stream"):
            raise UnsupportedMediaType(f"{where}: the server says {media or 'nothing'!r}, not an image type")
        if response.content_length is not None and response.content_length > self.max_bytes:
            raise PayloadTooLarge(f"{where}: {response.content_length} bytes; the limit is {self.max_bytes}")
        chunks = []
        size = 0
        async for chunk in response.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > self.max_bytes:
                raise PayloadTooLarge(f"{where}: over the limit of {self.max_bytes} bytes")
            if self.buffered + len(chunk) > self.max_buffered_bytes:
                raise QueueFull("images being fetched and uploaded hold too many bytes; retry later")
            self.buffered += len(chunk)
            held[0] += len(chunk)
            chunks.append(chunk)
        return ImageInput(b"".join(chunks), url[:255], media)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
