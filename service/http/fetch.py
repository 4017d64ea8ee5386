"""Images given by URL (``{"images": [{"url": ...}]}``), fetched by the gateway through the SSRF
guard (``service.ssrf``: the URL's form, and the address of every connection).

* **Scheme**: https only unless ``GATEWAY_URL_ALLOW_HTTP``.
* **Addresses**: only globally routable ones (an IPv6 form carrying an IPv4 address judged by that
  address) unless a network of ``GATEWAY_URL_ALLOWLIST`` holds them; checked on the address each
  connection is about to be made to, whatever form the host was written in (a literal, a name IDNA
  maps to an address, a resolved name): a name that answers a public address first and a private
  one next (DNS rebinding) gains nothing, and a refused address is answered 403 before any
  connection is attempted.
* **Form**: a URL that is not a well-formed http(s) URL with a valid host is a 400 saying why.
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
from collections.abc import AsyncIterator, Sequence

import aiohttp
from yarl import URL

from service.classifier import ImageInput
from service.errors import (
    GatewayError,
    PayloadTooLarge,
    QueueFull,
    UnsupportedMediaType,
    UrlFetchFailed,
    UrlNotAllowed,
)
from service.ssrf import Network, guarded_session, parse_url, refused_reason

REDIRECTS = frozenset({301, 302, 303, 307, 308})


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
                parsed = parse_url(url, where, self.allow_http)
                async with self._client().get(parsed, allow_redirects=False) as response:
                    if response.status in REDIRECTS and "Location" in response.headers:
                        url = _redirect_target(parsed, response.headers["Location"])
                        where = f"{origin}, redirected to {url[:200]}"
                        continue
                    return await self._read(response, url, where, held)
            raise UrlFetchFailed(f"{where}: more than {self.max_redirects} redirects")
        except GatewayError:
            raise
        except TimeoutError:
            raise UrlFetchFailed(f"{where}: no complete answer within {self.timeout:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            if (why := refused_reason(exc)) is not None:
                raise UrlNotAllowed(f"{where}: {why}") from None
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


def _redirect_target(base: URL, location: str) -> str:
    """Where a redirect leads (``location`` relative to ``base``), as text for ``parse_url``, which
    judges its form: a Location yarl cannot parse is answered as itself."""
    try:
        return str(base.join(URL(location)))
    except (ValueError, IndexError):  # IndexError: yarl 1.25 on "http://a[:]@"
        return location
