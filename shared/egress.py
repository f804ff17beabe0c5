"""Where webhooks may be sent: the address policy that keeps a client's webhook URL from reaching
llmq's own network (SSRF), set by ``LLMQ_WEBHOOK_ALLOW``.

Unset, any public address is allowed, and these are refused: loopback, link-local, private
(RFC 1918, ULA ``fc00::/7``, CGNAT ``100.64.0.0/10``), unspecified, multicast, reserved, cloud
metadata addresses, and names that are local by definition (``localhost``, ``*.localhost``,
``*.internal`` such as ``metadata.google.internal``). Set (comma-separated host names and CIDRs),
only what it lists is allowed, private destinations included: a listed name matches the URL's host
exactly (case-insensitively, trailing dot ignored); otherwise every address the host resolves to
must lie in a listed CIDR.

A URL is judged as httpx will connect it, so parser tricks judge what is really reached: the host
is httpx's (``http://public.example@127.0.0.1/`` is 127.0.0.1), numeric forms are read the way the
C resolver reads them (``2130706433``, ``0x7f.1``), and an IPv6 address that carries an IPv4 one
(``::ffff:127.0.0.1``, NAT64, 6to4) is judged by the IPv4 address.

The API checks at submit (:func:`check_url`); the housekeeper checks again at delivery and connects
to the very address it checked (:func:`pin`), so a name that re-resolves between the check and
the connection (DNS rebinding) cannot redirect the delivery.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
from dataclasses import dataclass, field

import httpx

__all__ = ["Refused", "Policy", "Target", "policy", "destination", "literal_address", "non_public", "resolve",
           "check_url", "pin", "SUBMIT_LOOKUP_S"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# A submit waits this long for DNS at most: a slow resolver must not hold a client's POST for the
# full delivery timeout, and the delivery checks again anyway.
SUBMIT_LOOKUP_S = 2.0

# Instance metadata services hand out credentials to whoever asks from inside. Most sit in
# link-local or private space anyway; Azure's wireserver (168.63.129.16) does not.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "168.63.129.16", "192.0.0.192"))
# Not globally reachable, yet not flagged by Python 3.11's ipaddress (is_global is True or the
# class is missing): the IETF protocol block, IPv6 site-local, NAT64's local-use prefix; CGNAT is
# named for the reason it gives.
_SPECIAL = ((ipaddress.ip_network("100.64.0.0/10"), "shared (CGNAT)"),
            (ipaddress.ip_network("192.0.0.0/24"), "IETF protocol"),
            (ipaddress.ip_network("fec0::/10"), "site-local"),
            (ipaddress.ip_network("64:ff9b:1::/48"), "local NAT64"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Names that can only mean this host or the cloud's metadata service; refused by name, as they may
# not resolve where the API runs but still do on the housekeeper.
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", "metadata",
                         "metadata.goog", "instance-data"})
LOCAL_SUFFIXES = (".localhost", ".internal")
# What the C resolver's inet_aton takes as an IPv4 address: 1-4 parts, decimal, octal or hex.
_NUMERIC_V4 = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$")
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")


class Refused(ValueError):
    """A destination the policy does not allow. ``message`` names the host, never an address a
    name resolved to (that would map the internal network for the client); ``address`` is the
    refused address, for the operator's log."""

    def __init__(self, message: str, address: Address | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.address = address


def _canonical(host: str) -> str:
    return host.lower().rstrip(".")


def literal_address(host: str) -> Address | None:
    """The address ``host`` spells, in any form the resolver accepts as numeric; None for a name."""
    host = _canonical(host)
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_V4.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _embedded(address: Address) -> Address:
    """The IPv4 address an IPv6 one leads to (mapped, NAT64, 6to4), else the address itself."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def non_public(address: Address) -> str | None:
    """Why ``address`` is not a public destination (its kind), or None if it is one."""
    inner = _embedded(address)
    if address in METADATA or inner in METADATA:
        return "cloud metadata"
    for kind, flag in (("unspecified", "is_unspecified"), ("loopback", "is_loopback"),
                       ("link-local", "is_link_local"), ("multicast", "is_multicast")):
        if getattr(inner, flag):
            return kind
    for network, kind in _SPECIAL:
        if inner in network or address in network:
            return kind
    if inner.is_private:
        return "private"
    if inner.is_reserved or not inner.is_global:
        return "reserved"
    return None


@dataclass(frozen=True)
class Policy:
    """``LLMQ_WEBHOOK_ALLOW`` parsed: empty means "public destinations only"."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, allow: str) -> Policy:
        """Raises ValueError naming every entry that is neither a CIDR/address nor a host name."""
        names: set[str] = set()
        networks: list[Network] = []
        bad: list[str] = []
        for entry in (e.strip() for e in allow.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = _canonical(entry)
            if _NAME.match(name):
                names.add(name)
            else:  # IDNs are listed in their xn-- form, as httpx sends them
                bad.append(entry)
        if bad:
            raise ValueError(f"LLMQ_WEBHOOK_ALLOW: not a host name or CIDR: {', '.join(bad)}")
        return cls(frozenset(names), tuple(networks))

    @property
    def restricted(self) -> bool:
        return bool(self.names or self.networks)

    def screen(self, host: str) -> bool:
        """Judge ``host`` before any lookup: True if it is allowed outright, False if its resolved
        addresses decide (:meth:`check_addresses`); raises :class:`Refused`."""
        name = _canonical(host)
        address = literal_address(name)
        if address is not None:
            self._check(address, f"{address} is")
            return True
        if self.restricted:
            if name in self.names:
                return True
            if not self.networks:
                raise Refused(f"{name} is not in LLMQ_WEBHOOK_ALLOW")
        elif name in LOCAL_NAMES or name.endswith(LOCAL_SUFFIXES):
            raise Refused(f"{name} is a local or cloud-metadata name")
        return False

    def check_addresses(self, host: str, addresses: list[Address]) -> None:
        """Every address ``host`` resolved to must be allowed; raises :class:`Refused`."""
        for address in addresses:
            self._check(address, f"{_canonical(host)} resolves to")

    def _check(self, address: Address, subject: str) -> None:
        if self.restricted:
            inner = _embedded(address)
            if not any(address in net or inner in net for net in self.networks):
                raise Refused(f"{subject} an address outside LLMQ_WEBHOOK_ALLOW", address)
        elif kind := non_public(address):
            raise Refused(f"{subject} a {kind} address", address)


@functools.lru_cache(maxsize=8)
def policy(allow: str) -> Policy:
    """The parsed policy of an ``LLMQ_WEBHOOK_ALLOW`` value (parsed once per value)."""
    return Policy.parse(allow)


def destination(url: str) -> tuple[httpx.URL, str, int]:
    """``url`` as httpx reads it, its host (ASCII, as sent on the wire) and port; raises
    :class:`Refused` for what httpx cannot send."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise Refused(f"not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise Refused("not an http(s) URL with a host")
    host = parsed.raw_host.decode("ascii")
    if literal_address(host) is None and not _NAME.match(_canonical(host)):
        raise Refused(f"{host!r} is not a host name")  # e.g. percent-encoded: no resolver reads it
    return parsed, host, parsed.port or (443 if parsed.scheme == "https" else 80)


async def resolve(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to, in the resolver's order; raises OSError if none."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


async def check_url(rules: Policy, url: str, *, timeout_s: float = SUBMIT_LOOKUP_S) -> None:
    """The submit-time check; raises :class:`Refused`. A name that does not resolve (or not within
    ``timeout_s``) passes: the resolver the API sees may differ from the housekeeper's, or be
    briefly down, and the delivery checks the addresses it really connects to anyway."""
    _, host, port = destination(url)
    if rules.screen(host):
        return
    try:
        async with asyncio.timeout(timeout_s):
            addresses = await resolve(host, port)
    except (OSError, TimeoutError):
        return
    rules.check_addresses(host, addresses)


@dataclass(frozen=True)
class Target:
    """A delivery pinned to one checked address: pass ``url``, ``headers`` and ``extensions`` to
    httpx. The URL names the address, so httpx makes no lookup of its own; ``Host`` and, for
    https, the TLS server name (SNI and certificate check) stay the URL's host name."""

    url: httpx.URL
    address: Address
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, str] = field(default_factory=dict)


async def pin(rules: Policy, url: str, *, timeout_s: float) -> Target:
    """The delivery-time check: resolve, check every address, pin the first. Raises
    :class:`Refused` (final), or OSError / TimeoutError when the name does not resolve (a
    transient failure, retried like a refused connection)."""
    parsed, host, port = destination(url)
    allowed = rules.screen(host)  # checks a literal address itself
    literal = literal_address(host)
    if literal is not None:
        address = literal
    else:
        async with asyncio.timeout(timeout_s):
            addresses = await resolve(host, port)
        if not allowed:
            rules.check_addresses(host, addresses)
        address = addresses[0]
    # Connection: close, as the pool keys connections by address: a kept-alive connection whose
    # certificate was checked for one name must not carry a delivery for another name.
    headers = {"Host": parsed.netloc.decode("ascii"), "Connection": "close"}
    extensions = {"sni_hostname": _canonical(host)} if parsed.scheme == "https" and literal is None else {}
    return Target(parsed.copy_with(host=str(address)), address, headers, extensions)
