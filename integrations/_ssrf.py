"""Which network addresses an outbound request may reach, checked after DNS resolution.

A destination taken from configuration or, worse, from a message payload can
name anything: ``localhost``, the cloud metadata service at ``169.254.169.254``,
a database on the private network. :class:`AddressPolicy` resolves the host,
refuses every address that is not globally routable (loopback, private,
link-local, site-local, multicast, reserved, unspecified, shared, benchmarking
and documentation ranges; IPv6 forms that embed such an IPv4 address too)
unless an explicit allow-list covers it, and hands back the checked addresses
so the caller connects to exactly those: a second lookup, which a rebinding DNS
server could answer differently, never happens.

A host is refused if *any* of its addresses is refused, so a name with one
public and one private record cannot be used to reach the private one.

What counts as refused is the explicit table below, the same on every Python
version, not the ``ipaddress`` module's ``is_private``/``is_global`` flags.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from typing import TypeAlias

from outbox import ConfigurationError

__all__ = ["AddressPolicy", "BlockedAddress", "IPAddress", "IPNetwork", "ResolutionFailed"]

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

_LOCALHOST = ipaddress.IPv4Address("127.0.0.1")


class BlockedAddress(Exception):
    """The destination resolves to an address the policy refuses; permanent for this target."""

    def __init__(self, host: str, address: IPAddress, reason: str) -> None:
        where = str(address) if host == str(address) else f"{host} ({address})"
        super().__init__(
            f"refusing to connect to {where}: {reason} address (SSRF guard); "
            "list its network in allowed_networks to permit it"
        )
        self.host = host
        self.address = address
        self.reason = reason


class ResolutionFailed(Exception):
    """DNS gave no usable answer for the host; usually transient."""


def parse_networks(networks: Iterable[str | IPNetwork]) -> tuple[IPNetwork, ...]:
    if isinstance(networks, str):
        networks = [networks]  # one CIDR given bare, not a sequence of characters
    parsed: list[IPNetwork] = []
    for network in networks:
        if isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network):
            parsed.append(network)
            continue
        try:
            parsed.append(ipaddress.ip_network(network, strict=False))
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"allowed_networks entries must be CIDRs such as '127.0.0.0/8' or '10.1.2.3/32', "
                f"got {network!r}"
            ) from None
    return tuple(parsed)


def _v4(network: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(network)


def _v6(network: str) -> ipaddress.IPv6Network:
    return ipaddress.IPv6Network(network)


# Which networks are refused, and why. The first entry that holds an address decides; an address in
# none of them is public. The verdicts are this table's, never the running Python's ``ipaddress``
# flags (``is_private``, ``is_global``, ...), whose tables differ between Python releases: 3.11 calls
# fec0::/10 and 3fff::/20 global, later releases do not. Reasons are what errors and the attempt's
# ``refused`` detail show; keep them stable.
_REFUSED_V4: tuple[tuple[ipaddress.IPv4Network, str], ...] = (
    # "This host"; connect() to it reaches the local machine on Linux.
    (_v4("0.0.0.0/32"), "unspecified"),
    # "This network" (RFC 791): Linux routes the rest of 0/8 to the local machine too.
    (_v4("0.0.0.0/8"), "private"),
    # RFC 1918 private networks.
    (_v4("10.0.0.0/8"), "private"),
    # Shared address space (RFC 6598): carrier-grade NAT, in-cloud service networks.
    (_v4("100.64.0.0/10"), "non-global"),
    # Loopback.
    (_v4("127.0.0.0/8"), "loopback"),
    # Link-local (RFC 3927), where cloud metadata services answer (169.254.169.254).
    (_v4("169.254.0.0/16"), "link-local"),
    # RFC 1918 private networks.
    (_v4("172.16.0.0/12"), "private"),
    # IETF protocol assignments (RFC 6890): DS-Lite, NAT64 discovery, PCP and TURN anycast; no receivers.
    (_v4("192.0.0.0/24"), "private"),
    # Documentation, TEST-NET-1 (RFC 5737).
    (_v4("192.0.2.0/24"), "private"),
    # RFC 1918 private networks.
    (_v4("192.168.0.0/16"), "private"),
    # Benchmarking (RFC 2544): lab networks, often routed internally.
    (_v4("198.18.0.0/15"), "private"),
    # Documentation, TEST-NET-2 (RFC 5737).
    (_v4("198.51.100.0/24"), "private"),
    # Documentation, TEST-NET-3 (RFC 5737).
    (_v4("203.0.113.0/24"), "private"),
    # Multicast (RFC 5771): never one receiver.
    (_v4("224.0.0.0/4"), "multicast"),
    # Reserved for future use (RFC 1112), and the limited broadcast 255.255.255.255.
    (_v4("240.0.0.0/4"), "reserved"),
)

# An entry with no reason is a form that embeds an IPv4 address (see _embedded_ipv4): it is judged by
# what it embeds, so the broader entries after it do not refuse it.
_REFUSED_V6: tuple[tuple[ipaddress.IPv6Network, str | None], ...] = (
    # The unspecified address.
    (_v6("::/128"), "unspecified"),
    # Loopback.
    (_v6("::1/128"), "loopback"),
    # IPv4-mapped (::ffff:a.b.c.d): an IPv6 socket sends IPv4 packets to the embedded address.
    (_v6("::ffff:0:0/96"), None),
    # NAT64 well-known prefix (RFC 6052): a translator forwards to the embedded IPv4 address.
    (_v6("64:ff9b::/96"), None),
    # IPv4-compatible (RFC 4291, deprecated): nothing routes to it; a private embedded address gets
    # its own reason first.
    (_v6("::/96"), "reserved"),
    # Local-use NAT64 prefix (RFC 8215): translates into the local network, by a prefix length we
    # cannot know.
    (_v6("64:ff9b:1::/48"), "reserved"),
    # Discard-only (RFC 6666).
    (_v6("100::/64"), "reserved"),
    # Teredo (RFC 4380): judged by the embedded server and client IPv4 addresses.
    (_v6("2001::/32"), None),
    # The rest of the IETF protocol assignments (RFC 2928): benchmarking, ORCHID, AS112, AMT, ...
    (_v6("2001::/23"), "private"),
    # Documentation (RFC 3849).
    (_v6("2001:db8::/32"), "private"),
    # 6to4 (RFC 3056): a relay forwards to the embedded IPv4 address.
    (_v6("2002::/16"), None),
    # Documentation (RFC 9637).
    (_v6("3fff::/20"), "private"),
    # Unique local addresses (RFC 4193): the IPv6 private networks.
    (_v6("fc00::/7"), "private"),
    # Link-local.
    (_v6("fe80::/10"), "link-local"),
    # Site-local (RFC 3879 deprecated it); some networks still route it internally.
    (_v6("fec0::/10"), "site-local"),
    # Multicast.
    (_v6("ff00::/8"), "multicast"),
    # Everything outside 2000::/3, the global unicast space, is reserved by the IETF (RFC 4291),
    # SRv6 SIDs in 5f00::/16 (RFC 9602) included.
    (_v6("::/3"), "reserved"),
    (_v6("4000::/2"), "reserved"),
    (_v6("8000::/2"), "reserved"),
    (_v6("c000::/3"), "reserved"),
    (_v6("e000::/4"), "reserved"),
    (_v6("f000::/5"), "reserved"),
    (_v6("f800::/6"), "reserved"),
    (_v6("fe00::/9"), "reserved"),
)

_IPV4_MAPPED = _v6("::ffff:0:0/96")
_NAT64 = _v6("64:ff9b::/96")
_IPV4_COMPATIBLE = _v6("::/96")
_LOW_32_BITS = 0xFFFFFFFF


def _embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses a packet to ``address`` may be delivered to, by the kernel or a translator."""
    compatible = address in _IPV4_COMPATIBLE and int(address) > 1  # :: and ::1 are not IPv4 forms
    if address in _IPV4_MAPPED or address in _NAT64 or compatible:
        return (ipaddress.IPv4Address(int(address) & _LOW_32_BITS),)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    if address.teredo is not None:
        server, client = address.teredo
        return (client, server)
    return ()


def _refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a public destination, or None if it is one."""
    if isinstance(address, ipaddress.IPv4Address):
        return next((reason for network, reason in _REFUSED_V4 if address in network), None)
    for embedded in _embedded_ipv4(address):
        reason = _refusal(embedded)
        if reason is not None:
            return reason
    return next((reason for network, reason in _REFUSED_V6 if address in network), None)


_NUMERIC_IPV4 = re.compile(r"^[0-9a-fA-FxX.]+$")


def literal_address(host: str) -> IPAddress | None:
    """The address ``host`` spells, or None for a name that DNS must answer.

    Besides the standard forms this takes the IPv4 shorthands the system
    resolver reads as numbers, never as names (``127.1``, ``2130706433``,
    ``0x7f.0.0.1``, ``0177.0.0.1``), so they are judged as the address they
    reach, before any DNS.
    """
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _NUMERIC_IPV4.match(host):
        return None
    try:  # AI_NUMERICHOST: parsed by the resolver's own rules, never looked up
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return None
    return ipaddress.IPv4Address(infos[0][4][0]) if infos else None


class AddressPolicy:
    """Public addresses only, plus whatever ``allowed_networks`` lists."""

    def __init__(self, allowed_networks: Iterable[str | IPNetwork] = ()) -> None:
        self.allowed_networks = parse_networks(allowed_networks)

    def __repr__(self) -> str:
        return f"<AddressPolicy allowed={[str(n) for n in self.allowed_networks]}>"

    def _allowed(self, address: IPAddress) -> bool:
        forms: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            forms.append(address.ipv4_mapped)
        return any(form in network for form in forms for network in self.allowed_networks)

    def refusal(self, address: IPAddress) -> str | None:
        """The reason ``address`` is refused, or None if it may be reached."""
        if self._allowed(address):
            return None
        return _refusal(address)

    def check(self, host: str, address: IPAddress) -> None:
        reason = self.refusal(address)
        if reason is not None:
            raise BlockedAddress(host, address, reason)

    def precheck(self, host: str) -> None:
        """The checks that need no DNS: an IP literal, or a name that always means loopback.

        ``localhost`` and ``*.localhost`` resolve to loopback wherever RFC 6761
        is followed. They are judged as 127.0.0.1, the address they always
        include: a refusal here is certain at delivery too, while ``::1``, which
        some hosts add, is left to :meth:`resolve`. Any other name passes here
        and is judged on its addresses by :meth:`resolve`.
        """
        literal = literal_address(host)
        name = host.lower().rstrip(".")
        if literal is None and (name == "localhost" or name.endswith(".localhost")):
            literal = _LOCALHOST
        if literal is not None:
            self.check(host, literal)

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """Every address of ``host``, all checked; raise on the first refused one.

        ``host`` is the ASCII (IDNA) form. A literal IP skips DNS.
        """
        literal = literal_address(host)
        if literal is not None:
            self.check(host, literal)
            return [literal]
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as exc:
            raise ResolutionFailed(f"cannot resolve {host}: {exc}") from None
        addresses: list[IPAddress] = []
        for _, _, _, _, sockaddr in infos:
            try:
                address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            except ValueError:  # not an IP family; nothing we could connect to
                continue
            if address not in addresses:
                addresses.append(address)
        if not addresses:
            raise ResolutionFailed(f"cannot resolve {host}: no IPv4 or IPv6 address")
        for address in addresses:
            self.check(host, address)
        return addresses
