"""Which network addresses an outbound request may reach, checked after DNS resolution.

A destination taken from configuration or, worse, from a message payload can
name anything: ``localhost``, the cloud metadata service at ``169.254.169.254``,
a database on the private network. :class:`AddressPolicy` resolves the host,
refuses every address that is not globally routable (loopback, private,
link-local, multicast, reserved, unspecified, shared, documentation ranges;
IPv6 forms that embed such an IPv4 address too) unless an explicit allow-list
covers it, and hands back the checked addresses so the caller connects to
exactly those: a second lookup, which a rebinding DNS server could answer
differently, never happens.

A host is refused if *any* of its addresses is refused, so a name with one
public and one private record cannot be used to reach the private one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import TypeAlias

from outbox import ConfigurationError

__all__ = ["AddressPolicy", "BlockedAddress", "IPAddress", "IPNetwork", "ResolutionFailed"]

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
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


def _refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a public destination, or None if it is one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return _refusal(embedded)
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("non-global", not address.is_global),  # e.g. 100.64.0.0/10, shared address space
    )
    for reason, hit in checks:
        if hit:
            return reason
    return None


def literal_address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


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
