"""Where a job's ``callback_url`` may point (docs/security.md, "Job callbacks").

A callback is a POST the job worker makes on a client's behalf, so it must not become
a way into the private network. A URL is allowed only when:

- its scheme is http or https, and it names a host;
- the host is listed in ``CONVEYOR_CALLBACK_HOSTS`` (host names, addresses or networks
  in CIDR form, comma-separated; empty: every callback is refused);
- every address the host resolves to is public, or is itself listed: loopback,
  link-local, private, shared, multicast, reserved and unspecified addresses are
  refused unless listed (a literal address in the URL is checked the same way).

The API checks at submission; the job worker checks again before each POST and then
connects to the very addresses it checked (:attr:`Target.addresses`), so a name that
resolves elsewhere by then (DNS rebinding) cannot reach a refused address.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from batching.errors import InvalidInput

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]
"""(host, port) -> the addresses it resolves to; raises ``OSError`` when it cannot."""


class CallbackRefused(InvalidInput):
    """The callback URL is outside the policy (a 400 at submission)."""


@dataclass(frozen=True, slots=True)
class AllowList:
    names: frozenset[str]
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, text: str) -> AllowList:
        names: set[str] = set()
        networks: list[Network] = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                names.add(_normal_name(entry))
        return cls(frozenset(names), tuple(networks))

    def listed(self, address: Address) -> bool:
        return any(address in network for network in self.networks)


@dataclass(frozen=True, slots=True)
class Target:
    """A checked callback: what to connect to, and the name to present there."""

    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_callback(url: str, allowed: AllowList, resolver: Resolver = resolve) -> Target:
    """The :class:`Target` of ``url``; :class:`CallbackRefused` when the policy says no.

    ``OSError`` from ``resolver`` (the name does not resolve now) passes through.
    """
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise CallbackRefused(f"parameters.callback_url {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise CallbackRefused(f"parameters.callback_url must be an http or https URL, got "
                              f"scheme {parts.scheme!r}")
    if not parts.hostname:
        raise CallbackRefused(f"parameters.callback_url {url!r} names no host")
    host = _normal_name(parts.hostname)
    literal = _address(host)
    if not allowed.names and not allowed.networks:
        raise CallbackRefused("callbacks are turned off on this server (CONVEYOR_CALLBACK_HOSTS "
                              "is empty)")
    if literal is None and host not in allowed.names:
        raise CallbackRefused(f"callback host {host!r} is not in CONVEYOR_CALLBACK_HOSTS")
    if literal is not None and not allowed.listed(literal):
        raise CallbackRefused(f"callback address {host} is not in CONVEYOR_CALLBACK_HOSTS")
    found = [literal] if literal is not None else [_address(a) for a in resolver(host, port)]
    addresses = [a for a in found if a is not None]
    if not addresses:
        raise OSError(f"callback host {host!r} resolves to no address")
    for address in addresses:
        if _special(address) and not allowed.listed(address):
            raise CallbackRefused(f"callback host {host!r} resolves to {address}, a "
                                  "non-public address; list that address in "
                                  "CONVEYOR_CALLBACK_HOSTS to allow it")
    return Target(parts.scheme, host, port, tuple(str(a) for a in addresses))


def _normal_name(name: str) -> str:
    return name.strip().lower().rstrip(".")


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _special(address: Address) -> bool:
    """Not a public unicast address: loopback, link-local, private, shared (100.64/10),
    multicast, reserved, unspecified, documentation and the like."""
    return (not address.is_global or address.is_multicast or address.is_reserved
            or address.is_unspecified or address.is_loopback or address.is_link_local)
