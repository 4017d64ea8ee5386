"""The one guard for every outbound URL (image fetches and webhooks): which URLs the gateway takes,
and which addresses it connects to.

* **Form** (``parse_url``): a URL is parsed once, by the HTTP client's own parser (yarl), and that
  parse is what is requested: no second parser's opinion of the host. http or https (https only
  unless the caller allows http), a host that is a DNS name (labels of 1-63 letters, digits, ``-``
  or ``_``; at most 253 characters) or a canonical address, no credentials, no control characters,
  at most ``MAX_URL`` characters. Anything else is a 400 saying what is wrong, never an exception
  from a parser (yarl and the IDNA codec raise ValueError and UnicodeError).
* **Addresses** (``refusal``): only globally routable ones; private, loopback, link-local (cloud
  metadata at 169.254.169.254 included), shared, reserved and multicast addresses are refused unless
  a network of the allow-list holds them. An IPv6 address that carries an IPv4 address is judged by
  the IPv4 address it carries (``embedded_ipv4``); the forms whose embedding cannot be read are
  refused (``REFUSED_RANGES``).
* **The check at connect time** (``guarded_session``): the connector's ``socket_factory``, which
  aiohttp calls with the address it is about to connect to, refuses it before a socket exists. Every
  host form reaches it, a literal address (which aiohttp connects to without asking a resolver), a
  name IDNA maps to an address (``127。0。0。1``), a resolved name: this is the check that cannot
  be bypassed. As no connection is attempted, the refusal reads the same whether anything listens
  there or not.
* **Names** are also checked where they are resolved (``GuardedResolver``): one name, one verdict
  (a name with any refused address is refused), and an error that names the host and the kind of
  address, never the address (the gateway is no oracle of its internal DNS).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import re
import socket
from collections.abc import Callable, Sequence

import aiohttp
from aiohappyeyeballs import AddrInfoType
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from service.errors import BadRequest, UrlNotAllowed

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
RESOLVE_TIMEOUT = 5.0
MAX_URL = 2048
"""Characters in a URL (as for a JSON body's image URL and for ``Webhook-URL``): also a redirect's."""
MAX_HOST = 253
_LABEL = re.compile(r"[a-z0-9_-]{1,63}", re.IGNORECASE | re.ASCII)
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*", re.IGNORECASE | re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_AUTHORITY = re.compile(r"[^/?#]*//(?:[^/?#]*@)?([^/?#]*)")
"""The host and port of a URL's text, as yarl splits them (after the credentials)."""

_V6 = ipaddress.IPv6Network
EMBEDDING_RANGES: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("::ffff:0:0/96"), "IPv4-mapped"),
    (_V6("::ffff:0:0:0/96"), "SIIT"),  # IPv4-translated (RFC 2765)
    (_V6("64:ff9b::/96"), "NAT64"),  # the well-known prefix (RFC 6052)
    (_V6("::/96"), "IPv4-compatible"),  # deprecated (RFC 4291), still routed by some tunnels
)
"""IPv6 ranges whose low 32 bits are an IPv4 address the packets end up at (a translator or tunnel
on the way delivers them there): the address is judged by the IPv4 address. 6to4 (2002::/16)
carries its IPv4 address in bits 16-47 (``IPv6Address.sixtofour``)."""
REFUSED_RANGES: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("64:ff9b:1::/48"), "a local-use NAT64 address (RFC 8215: the operator chooses where the IPv4 address is)"),
    (_V6("2001::/32"), "a Teredo address (its relay reaches an IPv4 address hidden, inverted, in it)"),
    (_V6("fec0::/10"), "a site-local address (deprecated by RFC 3879, still routed inside some sites)"),
)
"""IPv6 ranges refused whatever the address: their IPv4 address cannot be read from the address
alone (local-use NAT64), or no image host or webhook receiver needs them (Teredo, site-local)."""


def parse_allowlist(text: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part.strip())


def embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address that ``address`` carries, and the form that carries it (``EMBEDDING_RANGES``,
    6to4), if any. ``::`` and ``::1`` are the unspecified and loopback addresses, not IPv4-compatible."""
    if address.sixtofour is not None:
        return address.sixtofour, "6to4"
    if int(address) <= 1:
        return None
    for network, form in EMBEDDING_RANGES:
        if address in network:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF), form
    return None


def refusal(address: Address, allowlist: Sequence[Network], name: str | None = None) -> str | None:
    """Why the gateway must not connect to ``address`` (None: it may). With ``name``, the host name
    that resolved to ``address``, the reason names the host and the kind of address, never the
    address: what an internal name resolves to is not the client's to learn."""
    if any(address in network for network in allowlist):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        for network, kind in REFUSED_RANGES:
            if address in network:
                return _reason(address, name, kind)
        if (embedded := embedded_ipv4(address)) is not None:
            inner, form = embedded
            why = refusal(inner, allowlist, name)
            if why is None:
                return None
            return f"{why} (in {form} form)" if name is not None else f"{why} (the {form} address {address} carries it)"
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
        return _reason(address, name, f"a {kind} address")
    return None


def _reason(address: Address, name: str | None, kind: str) -> str:
    return f"{address} is {kind}" if name is None else f"{name} resolves to {kind}"


def parse_url(url: str, where: str, allow_http: bool) -> URL:
    """``url`` as the HTTP client will request it, if its form is one the gateway fetches (see the
    module's docstring); ``where`` starts each error. The address is checked where it is connected to."""
    if len(url) > MAX_URL:
        raise BadRequest(f"{where}: {len(url)} characters; at most {MAX_URL}")
    if (control := _CONTROL.search(url)) is not None:
        raise BadRequest(f"{where}: control character {control.group()!r} in the URL")
    try:
        parsed = URL(url)  # yarl checks the port and encodes the host (IDNA) here
        host = parsed.raw_host
        _ = parsed.host  # and decodes it here: an invalid A-label ("xn--") fails
    except (ValueError, IndexError) as exc:  # UnicodeError (the IDNA codec) included; IndexError: yarl
        raise BadRequest(f"{where}: not a valid URL ({exc})") from None  # on "http://a[:]@" (1.25)
    schemes = ("https", "http") if allow_http else ("https",)
    if parsed.scheme not in schemes:
        raise (BadRequest if parsed.scheme not in ("http", "https") else UrlNotAllowed)(
            f"{where}: scheme {parsed.scheme or 'missing'!r}; only {' and '.join(schemes)} URLs are allowed"
        )
    if not host:
        raise BadRequest(f"{where}: no host in the URL")
    if parsed.raw_user is not None or parsed.raw_password is not None:
        raise BadRequest(f"{where}: credentials in the URL are not accepted")
    if (fault := host_fault(host)) is not None:
        raise BadRequest(f"{where}: {fault}")
    if literal(host) is None and (authority := _AUTHORITY.match(url)) and authority[1].startswith("["):
        raise BadRequest(f"{where}: {host!r} in brackets; brackets hold only an IPv6 address")  # IPvFuture
    return parsed


def host_fault(host: str) -> str | None:
    """What is wrong with ``host`` (yarl's form: IDNA-encoded, IPv6 without brackets) as a host the
    gateway connects to; None if nothing."""
    if "%" in host and ":" in host:
        return f"{host!r}: an IPv6 address with a zone (scope) is not accepted"
    if literal(host) is not None:
        return None
    name = host.removesuffix(".")
    labels = name.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):  # read as an IPv4 address by browsers and by inet_aton
        return f"{host!r} is not a canonical address (write IPv4 addresses as four decimal numbers)"
    if len(name) > MAX_HOST:
        return f"the host name has {len(name)} characters; at most {MAX_HOST}"
    for label in labels:
        if not label:
            return f"{host!r} has an empty label (two dots in a row, or a leading dot)"
        if not _LABEL.fullmatch(label):
            return f"{host!r} is not a valid host name: labels are 1-63 letters, digits, '-' or '_'"
    return None


def literal(host: str) -> Address | None:
    """``host`` as an address, when it is one (yarl's form)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class AddressRefused(OSError):
    """The guard refused an address before any connection to it (an OSError, so that aiohttp
    reports it as a connector error, with this as its ``os_error``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.EACCES, reason)
        self.reason = reason


def refused_reason(exc: BaseException) -> str | None:
    """The guard's reason when ``exc``, raised by a request of a ``guarded_session``, is its refusal."""
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, AddressRefused):
        return exc.os_error.reason
    return None


def guarded_socket(allowlist: Sequence[Network]) -> Callable[[AddrInfoType], socket.socket]:
    """A ``socket_factory`` for aiohttp's TCPConnector: a socket for an address the guard allows,
    ``AddressRefused`` (before any socket exists) for any other."""
    allowed = tuple(allowlist)

    def create(addr_info: AddrInfoType) -> socket.socket:
        family, kind, proto, _, sockaddr = addr_info
        address = literal(str(sockaddr[0]))
        why = f"{sockaddr[0]!r} is not an address" if address is None else refusal(address, allowed)
        if why is not None:
            raise AddressRefused(f"{why}; the gateway does not connect to it")
        return socket.socket(family, kind, proto)

    return create


class GuardedResolver(AbstractResolver):
    """The system resolver, answering only addresses the guard allows (and refusing a name with any
    other: one name, one verdict), with a message naming the host."""

    def __init__(self, allowlist: Sequence[Network]) -> None:
        self.allowlist = tuple(allowlist)
        self._resolver = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._resolver.resolve(host, port, family)
        for result in results:
            address = literal(result["host"])
            why = (
                f"{host} resolves to what is not an address"
                if address is None
                else refusal(address, self.allowlist, host)
            )
            if why is not None:
                raise AddressRefused(f"{why}; the gateway does not connect to it")
        return results

    async def close(self) -> None:
        await self._resolver.close()


def guarded_session(
    allowlist: Sequence[Network], *, timeout: float, limit: int, headers: dict[str, str]
) -> aiohttp.ClientSession:
    """An HTTP client that connects only to addresses the guard allows (checked on the address of
    each connection, and where each name is resolved), with a total ``timeout`` per request, at most
    ``limit`` connections (an eighth of them per host: one slow host must not hold them all), no
    proxy from the environment, and no decompression (a size cap is on the bytes received, never on
    what they inflate to). Its refusals are ``ClientConnectorError``s (``refused_reason``)."""
    connector = aiohttp.TCPConnector(
        resolver=GuardedResolver(allowlist),
        socket_factory=guarded_socket(allowlist),
        use_dns_cache=False,
        limit=limit,
        limit_per_host=max(1, limit // 8),
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout),
        auto_decompress=False,
        headers=headers,
        trust_env=False,
    )


async def check_destination(url: str, where: str, allow_http: bool, allowlist: Sequence[Network]) -> str:
    """``url`` if ``parse_url`` takes it and every address of its host (resolved now) is allowed: for
    a URL the gateway will connect to later (a webhook), so that a refusal is an answer to the
    request that gave it. The connection checks again (the name may resolve elsewhere by then)."""
    host = parse_url(url, where, allow_http).raw_host or ""
    address = literal(host)
    if address is not None:
        if (why := refusal(address, allowlist)) is not None:
            raise UrlNotAllowed(f"{where}: {why}; the gateway does not connect to it")
        return url
    resolver = GuardedResolver(allowlist)
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT):
            await resolver.resolve(host, 0, socket.AF_UNSPEC)
    except AddressRefused as exc:
        raise UrlNotAllowed(f"{where}: {exc.reason}") from None
    except (OSError, TimeoutError):
        raise BadRequest(f"{where}: the host {host!r} cannot be resolved") from None
    finally:
        await resolver.close()
    return url
