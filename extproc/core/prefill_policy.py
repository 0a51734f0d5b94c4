"""Who may be a prefill target. Pure: parsing of the allow-list and the decision for one address.

``x-prefiller-host-port`` makes us open a connection to an address taken from a request header and
send it the client's prompt and credentials, so the target is checked before any connection:

* With an allow-list (PD_EXTPROC_PREFILL_ALLOW), a target must match a rule: an IP in a CIDR, or a
  host name equal to a name rule (``*.`` prefix = any subdomain), on an allowed port.
* Without one, the default refuses loopback (allowed in demo mode), link-local (including the cloud
  metadata address 169.254.169.254 and fe80::/10), and private-use ranges are allowed.
* Always refused, list or not: unspecified, multicast and broadcast addresses (never a TCP peer).
  A name allowed by a name rule may not resolve to a link-local address unless a CIDR rule allows it.

IPv4-mapped IPv6 addresses are checked as the IPv4 address they carry.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAME = re.compile(r"(\*\.)?(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


@dataclass(frozen=True, slots=True)
class PortRange:
    low: int
    high: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high


@dataclass(frozen=True, slots=True)
class Rule:
    network: IPNetwork | None  # an address rule, or
    name: str | None  # a host-name rule (lower-case; may start with "*.")
    ports: PortRange

    def matches_ip(self, ip: IPAddress, port: int) -> bool:
        return self.network is not None and ip.version == self.network.version and ip in self.network \
            and port in self.ports

    def matches_name(self, host: str, port: int) -> bool:
        if self.name is None or port not in self.ports:
            return False
        if self.name.startswith("*."):
            return host.endswith(self.name[1:]) and host != self.name[2:]
        return host == self.name


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    rules: tuple[Rule, ...]  # empty = the default policy
    allow_loopback: bool = False  # demo mode, default policy only

    @property
    def explicit(self) -> bool:
        return bool(self.rules)

    def allows_name(self, host: str, port: int) -> bool:
        """True if a host name is allowed by a name rule (its addresses are still checked)."""
        return any(rule.matches_name(host, port) for rule in self.rules)

    def allows_address(self, ip: IPAddress, port: int, *, name_allowed: bool = False) -> bool:
        """The decision for one address we are about to connect to."""
        ip = _unmapped(ip)
        if ip.is_unspecified or ip.is_multicast or ip == _BROADCAST:
            return False
        if self.rules:
            if any(rule.matches_ip(ip, port) for rule in self.rules):
                return True
            # A name rule trusts the name, not whatever it resolves to: never link-local through it.
            return name_allowed and not ip.is_link_local
        if ip.is_loopback:
            return self.allow_loopback
        return not ip.is_link_local


def _unmapped(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _ports(text: str) -> PortRange:
    if text == "*":
        return PortRange(1, 65535)
    low_text, _, high_text = text.partition("-")
    if not low_text.isdigit() or (high_text and not high_text.isdigit()):
        raise ValueError(f"bad port range {text!r}")
    low, high = int(low_text), int(high_text or low_text)
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"bad port range {text!r}")
    return PortRange(low, high)


def parse_rule(text: str) -> Rule:
    """``10.0.0.0/8:8000-8999``, ``[fd00::]/8:*``, ``10.1.2.3:8000``, ``prefill.llm.svc:8000``."""
    text = text.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"bad rule {text!r}: unclosed [")
        address, rest = text[1:close], text[close + 1:]
        prefix, sep, ports = rest.partition(":")
        if not sep or (prefix and not prefix.startswith("/")):
            raise ValueError(f"bad rule {text!r}: expected [v6]/len:ports")
        return Rule(ipaddress.ip_network(address + prefix, strict=True), None, _ports(ports))
    host, sep, ports = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bad rule {text!r}: expected host:ports")
    try:
        network = ipaddress.ip_network(host, strict=True)
    except ValueError:
        network = None
    if network is not None:
        return Rule(network, None, _ports(ports))
    name = host.lower()
    if not _NAME.fullmatch(name) or len(name) > 253:
        raise ValueError(f"bad rule {text!r}: not a CIDR or host name")
    return Rule(None, name, _ports(ports))


def parse_allow_list(text: str) -> tuple[Rule, ...]:
    return tuple(parse_rule(part) for part in text.split(",") if part.strip())


def first_allowed(policy: PrefillPolicy, addresses: Iterable[IPAddress], port: int,
                  name_allowed: bool = False) -> IPAddress | None:
    for ip in addresses:
        if policy.allows_address(ip, port, name_allowed=name_allowed):
            return _unmapped(ip)
    return None


def describe(rules: Sequence[Rule]) -> str:
    def one(rule: Rule) -> str:
        ports = "*" if (rule.ports.low, rule.ports.high) == (1, 65535) else (
            str(rule.ports.low) if rule.ports.low == rule.ports.high else f"{rule.ports.low}-{rule.ports.high}")
        if rule.network is not None:
            net = f"[{rule.network.network_address}]/{rule.network.prefixlen}" if rule.network.version == 6 \
                else str(rule.network)
            return f"{net}:{ports}"
        return f"{rule.name}:{ports}"

    return ",".join(one(rule) for rule in rules)
