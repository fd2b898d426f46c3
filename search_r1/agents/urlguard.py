"""The URL guard: agents never fetch private, local or non-web addresses.

A model chooses the URLs an agent opens, and a web page or a prompt injection can steer it. Left
unguarded, `access http://169.254.169.254/latest/meta-data/` reads a cloud machine's credentials and
`http://127.0.0.1:8000/...` reaches services that trust localhost (SSRF). So:

- `check_url(url)` refuses every scheme but http and https (file, ftp, gopher, data, ...), then
  resolves the host and refuses it if ANY address is loopback, private (RFC 1918, fc00::/7),
  link-local (169.254/16, fe80::/10, which holds the 169.254.169.254 metadata service), multicast,
  unspecified, reserved or otherwise not globally routable (100.64/10, ...). IPv4-mapped IPv6
  addresses are judged by their IPv4 address. Hosts like `localhost`, `2130706433` or a DNS name
  pointing at 10.0.0.1 are refused through their resolved addresses, not their spelling.
- `GuardedNetworkBackend` repeats the check when the connection is opened, on the addresses it
  connects to: a name that resolved to a public address at check time and to 127.0.0.1 a moment
  later (DNS rebinding) is refused, because the socket only ever connects to checked addresses.
- Redirects: `webpage.PageFetcher` follows them itself and checks every hop the same way.

`allow_private=True` (the agents' `--allow-private-urls`) lifts the address checks (for an intranet
or a local test server); `allowed_networks` lifts them for the listed networks only. Non-http(s)
schemes are refused regardless. The resolver is a parameter, so tests can point names anywhere
without touching /etc/hosts or the network.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

import httpcore

ALLOWED_SCHEMES = ("http", "https")
# Cloud metadata endpoints (AWS / GCP / Azure / OpenStack at 169.254.169.254, AWS's IPv6 one): named
# in the refusal, though link-local already covers the IPv4 one.
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})

Resolver = Callable[[str, int], list[str]]


class BlockedURLError(ValueError):
    """The URL is not one an agent may fetch (scheme or address); the message says why and the fix."""


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (the operating system's resolver), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def address_problem(address: str, allowed_networks=()) -> str | None:
    """Why an agent must not connect to `address` ("loopback", "private", ...), or None if it may.

    >>> address_problem("10.1.2.3"), address_problem("93.184.216.34")
    ('private', None)
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(ip in ipaddress.ip_network(net, strict=False) for net in allowed_networks):
        return None
    for problem, hit in (("cloud metadata service", ip in METADATA_ADDRESSES), ("loopback", ip.is_loopback),
                         ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                         ("unspecified", ip.is_unspecified), ("private", ip.is_private),
                         ("reserved", ip.is_reserved), ("not globally routable", not ip.is_global)):
        if hit:
            return problem
    return None


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        raise BlockedURLError(f"{url!r}: scheme {scheme or '(none)'!r} is not allowed; agents open http:// and "
                              "https:// pages only")
    try:
        port = parts.port
    except ValueError:
        raise BlockedURLError(f"{url!r}: the port is not a number in 0-65535") from None
    if not parts.hostname:
        raise BlockedURLError(f"{url!r} has no host name")
    return parts.hostname, port or (443 if scheme == "https" else 80)


def check_url(url: str, *, allow_private: bool = False, allowed_networks=(),
              resolver: Resolver = system_resolver) -> list[str]:
    """The addresses `url`'s host resolves to, if an agent may fetch it; else BlockedURLError.

    Refuses non-http(s) schemes always, and (unless `allow_private`) any host with an address that
    `address_problem` objects to; a host that does not resolve raises OSError. See the module docstring.
    """
    host, port = _host_port(url)
    return checked_addresses(host, port, allow_private=allow_private, allowed_networks=allowed_networks,
                             resolver=resolver, url=url)


def checked_addresses(host: str, port: int, *, allow_private: bool = False, allowed_networks=(),
                      resolver: Resolver = system_resolver, url: str | None = None) -> list[str]:
    """`host`'s addresses (an IP literal is its own), each checked; BlockedURLError if any is refused."""
    try:
        addresses = [str(ipaddress.ip_address(host.strip("[]").split("%", 1)[0]))]
    except ValueError:
        addresses = list(resolver(host, port))
        if not addresses:
            raise OSError(f"{host} did not resolve to any address") from None
    if not allow_private:
        for address in addresses:
            problem = address_problem(address, allowed_networks)
            if problem:
                where = url or f"{host}:{port}"
                shown = host if host == address else f"{host} ({address})"
                raise BlockedURLError(f"{where!r}: {shown} is a {problem} address; agents fetch public addresses "
                                      "only (--allow-private-urls lifts this for trusted networks)")
    return addresses


@dataclass(frozen=True)
class UrlGuard:
    """The guard's settings, shared by `check` (before a request) and the connection backend."""

    allow_private: bool = False
    allowed_networks: tuple[str, ...] = ()
    resolver: Resolver = field(default=system_resolver, compare=False)

    def __post_init__(self):
        for net in self.allowed_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"allowed network {net!r} is not an address or CIDR network like "
                                 "'10.0.0.0/8'") from None

    def check(self, url: str) -> list[str]:
        return check_url(url, allow_private=self.allow_private, allowed_networks=self.allowed_networks,
                         resolver=self.resolver)

    def addresses(self, host: str, port: int) -> list[str]:
        return checked_addresses(host, port, allow_private=self.allow_private,
                                 allowed_networks=self.allowed_networks, resolver=self.resolver)


class GuardedNetworkBackend(httpcore.SyncBackend):
    """httpcore's socket backend, connecting only to addresses the guard accepts at connect time.

    The host is resolved here (once per connection) and the socket opened to the checked address
    itself, so no second, unchecked resolution happens between the check and the connect. TLS still
    verifies the certificate against the URL's host name (httpcore passes it as server_hostname).
    """

    def __init__(self, guard: UrlGuard):
        self.guard = guard

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        last: Exception | None = None
        for address in self.guard.addresses(host, port):
            try:
                return super().connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                           socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        raise last if last is not None else httpcore.ConnectError(f"no address to connect to for {host}")
