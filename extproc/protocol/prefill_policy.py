"""Who may be a prefill target. Pure: parsing of the allow-list and the decision for one address.

``x-prefiller-host-port`` makes us open a connection to an address taken from a request header and
send it the client's prompt and credentials, so the target is checked before any connection:

* With an allow-list (PD_EXTPROC_PREFILL_ALLOW), a target must match a rule: an IP in a CIDR, or a
  host name equal to a name rule (``*.`` prefix = any subdomain), on an allowed port.
* Without one, the default refuses loopback (allowed in demo mode) and link-local (169.254.0.0/16,
  fe80::/10); private-use ranges are allowed. Outside demo mode the server does not start with the
  default policy unless trusted sources limit who may name a target (config.py open_prefill_policy).
* Always refused, list or not: unspecified, 0.0.0.0/8, multicast and broadcast addresses (never a TCP
  peer) and the cloud providers' metadata and platform addresses (METADATA, each with its source).
  A name allowed by a name rule may not resolve to a link-local address unless a CIDR rule allows it.

An IPv6 address that carries an IPv4 address is checked as each IPv4 address it may carry as well
(embedded): IPv4-mapped (::ffff:0:0/96) and IPv4-compatible (::/96), NAT64 (64:ff9b::/96 and the
local-use 64:ff9b:1::/48 at every RFC 6052 prefix length it can hold), 6to4 (2002::/16) and Teredo
(2001::/32: its server and its client). A NAT64 gateway or 6to4 relay would otherwise carry our
connection to the IPv4 address the policy refuses.
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
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # RFC 1122 "this host on this network": Linux dials itself

# Cloud metadata and platform endpoints: never a prefill worker, refused whatever the rules say.
METADATA: tuple[tuple[IPAddress, str], ...] = tuple((ipaddress.ip_address(address), source) for address, source in (
    ("169.254.169.254", "AWS, GCP, Azure, OpenStack... instance metadata"),
    ("169.254.170.2", "AWS ECS task metadata and credentials endpoint"),
    ("fd00:ec2::254", "AWS IMDS over IPv6 (AWS whitepaper 'IPv6 on AWS', Supporting Amazon VPC services)"),
    ("fd00:ec2::253", "AWS Route 53 resolver over IPv6 (same page)"),
    ("fd00:ec2::123", "AWS time sync over IPv6 (same page)"),
    ("100.100.100.200", "Alibaba Cloud ECS instance metadata (Alibaba Cloud ECS docs, Instance metadata)"),
    ("168.63.129.16", "Azure WireServer (Microsoft Learn, 'What is IP address 168.63.129.16?')"),
    ("169.254.170.23", "Amazon EKS Pod Identity Agent (Amazon EKS User Guide, 'EKS Pod Identity')"),
    ("fd00:ec2::23", "Amazon EKS Pod Identity Agent over IPv6 (same page)"),
    ("fd20:ce::254", "Google Compute Engine metadata server over IPv6 (Compute Engine docs, 'About VM metadata')"),
    ("fd00:42::42", "Scaleway instance metadata over IPv6 (Scaleway docs, Instances metadata API)"),
))
_METADATA_ADDRESSES = frozenset(address for address, _ in METADATA)

_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_COMPATIBLE = ipaddress.IPv6Network("::/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")
_TEREDO = ipaddress.IPv6Network("2001::/32")


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
        carried = (ip, *embedded(ip))
        if _never(ip) or any(address in _METADATA_ADDRESSES for address in carried):
            return False
        if self.rules:
            if any(rule.matches_ip(ip, port) for rule in self.rules):
                return True
            # A name rule trusts the name, not whatever it resolves to: never link-local through it.
            return name_allowed and not any(address.is_link_local for address in carried)
        if any(address.is_loopback for address in carried):
            return self.allow_loopback and not any(address.is_link_local for address in carried)
        return not any(address.is_link_local for address in carried)


def _never(ip: IPAddress) -> bool:
    """Never a prefill worker to dial, whatever the rules: not a unicast peer, this host, or a cloud's own
    endpoint. (An embedded address is checked for the metadata endpoints, loopback and link-local only: the
    zero bits around it in 64:ff9b:1::/48 would read as 0.0.0.0/8.)"""
    return (ip.is_unspecified or ip.is_multicast or ip == _BROADCAST or ip in _METADATA_ADDRESSES
            or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK))


def _v4(value: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(value & 0xFFFFFFFF)


def _rfc6052(value: int, prefix_len: int) -> ipaddress.IPv4Address:
    """The IPv4 address an RFC 6052 (section 2.2) address of this prefix length carries: bits 64-71 (the
    "u" octet) are never part of it."""
    if prefix_len == 96:
        return _v4(value)
    bits_before_u = 64 - prefix_len  # the IPv4 bits that sit between the prefix and the u octet
    high = (value >> 64) & ((1 << bits_before_u) - 1)
    low_bits = 32 - bits_before_u
    low = (value >> (56 - low_bits)) & ((1 << low_bits) - 1)
    return _v4((high << low_bits) | low)


def embedded(ip: IPAddress) -> tuple[ipaddress.IPv4Address, ...]:
    """Every IPv4 address an IPv6 address may carry to a translator or relay (module docstring)."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return ()
    value = int(ip)
    if ip in _MAPPED or ip in _COMPATIBLE or ip in _NAT64:
        return (_v4(value),)
    if ip in _NAT64_LOCAL:
        return tuple(_rfc6052(value, length) for length in (48, 56, 64, 96))
    if ip in _SIXTOFOUR:
        return (_v4(value >> 80),)
    if ip in _TEREDO:
        assert ip.teredo is not None
        return ip.teredo  # (server, client), the client de-obfuscated
    return ()


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
