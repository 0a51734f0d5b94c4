"""The prefill target policy: allow-list rules and the default."""

from __future__ import annotations

import ipaddress

import pytest

from extproc.protocol.prefill_policy import METADATA, PrefillPolicy, describe, first_allowed, parse_allow_list

ip = ipaddress.ip_address


@pytest.mark.parametrize("address,port,allowed", [
    ("10.1.2.3", 8000, True), ("10.1.2.3", 9000, False), ("11.0.0.1", 8000, False),
    ("fd00::5", 1, True), ("fe80::1", 8000, False), ("::ffff:10.1.2.3", 8000, True),
    ("192.168.1.9", 8200, True), ("192.168.1.10", 8200, False),
], ids=str)
def test_explicit_rules_check_address_and_port(address: str, port: int, allowed: bool) -> None:
    policy = PrefillPolicy(parse_allow_list("10.0.0.0/8:8000-8999, [fd00::]/8:*, 192.168.1.9:8200"))
    assert policy.allows_address(ip(address), port) is allowed


@pytest.mark.parametrize("address,allowed", [
    ("10.0.0.1", True), ("8.8.8.8", True), ("127.0.0.1", False), ("::1", False), ("169.254.169.254", False),
    ("fe80::1", False), ("224.0.0.1", False), ("0.0.0.0", False), ("255.255.255.255", False), ("::", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
], ids=str)
def test_default_policy(address: str, allowed: bool) -> None:
    assert PrefillPolicy(()).allows_address(ip(address), 8000) is allowed


def test_demo_mode_allows_loopback_but_not_metadata() -> None:
    demo = PrefillPolicy((), allow_loopback=True)
    assert demo.allows_address(ip("127.0.0.1"), 1) and not demo.allows_address(ip("169.254.169.254"), 80)


def test_unspecified_multicast_broadcast_are_refused_even_when_listed() -> None:
    policy = PrefillPolicy(parse_allow_list("0.0.0.0/0:*,[::]/0:*"))
    for address in ("0.0.0.0", "224.0.0.1", "255.255.255.255", "ff02::1", "::"):
        assert not policy.allows_address(ip(address), 80), address
    assert policy.allows_address(ip("169.254.1.1"), 80), "an explicit list is the operator's choice"


def _teredo(server: str, client: str) -> str:
    """A Teredo address (RFC 4380): prefix, server, flags, obfuscated port, obfuscated client."""
    value = (0x20010000 << 96) | (int(ip(server)) << 64) | (0x8000 << 48) | (0xFFFF << 32) \
        | (~int(ip(client)) & 0xFFFFFFFF)
    return str(ipaddress.IPv6Address(value))


# The forms of an internal IPv4 address a translator or relay would carry us to (finding: NAT64, 6to4
# and the cloud metadata addresses were allowed by the default policy).
_CARRIED_FORBIDDEN = [
    "64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "64:ff9b::6464:64c8",  # NAT64 well-known /96
    "64:ff9b:1::a9fe:a9fe", "64:ff9b:1:a9fe:a9:fe00::", "64:ff9b:1:a9:fe:a9fe::", "64:ff9b:1:0:a9:fea9:fe00:0",
    "2002:a9fe:a9fe::1", "2002:7f00:1::", "2002:6464:64c8::",  # 6to4
    _teredo("65.54.227.120", "169.254.169.254"), _teredo("127.0.0.1", "8.8.8.8"),  # Teredo client, server
    "::a9fe:a9fe", "::ffff:100.100.100.200",  # IPv4-compatible, IPv4-mapped
]
_METADATA_AND_THIS_HOST = ["fd00:ec2::254", "fd00:ec2::253", "fd00:ec2::123", "100.100.100.200", "168.63.129.16",
                           "169.254.170.23", "fd00:ec2::23", "fd20:ce::254", "fd00:42::42",
                           "169.254.170.2", "0.0.0.1", "0.1.2.3", "0.255.255.255", "::ffff:0.0.0.5"]


@pytest.mark.parametrize("address", _CARRIED_FORBIDDEN + _METADATA_AND_THIS_HOST)
def test_default_policy_refuses_internal_addresses_in_every_form(address: str) -> None:
    assert not PrefillPolicy(()).allows_address(ip(address), 80)


@pytest.mark.parametrize("address", ["64:ff9b::a00:1", "64:ff9b:1::a00:1", "2002:a00:1::",
                                     _teredo("65.54.227.120", "192.0.2.45"), "100.100.100.201", "fd00:ec2::1"])
def test_default_policy_allows_the_same_forms_of_ordinary_addresses(address: str) -> None:
    assert PrefillPolicy(()).allows_address(ip(address), 80)


@pytest.mark.parametrize("address", [*_METADATA_AND_THIS_HOST, "64:ff9b::a9fe:a9fe", "2002:6464:64c8::"])
def test_metadata_and_this_network_are_refused_even_when_listed(address: str) -> None:
    policy = PrefillPolicy(parse_allow_list("0.0.0.0/0:*,[::]/0:*"))
    assert not policy.allows_address(ip(address), 80)


def test_metadata_table_names_a_source_for_each_address() -> None:
    assert all(source for _, source in METADATA)
    assert {str(address) for address, _ in METADATA} >= {"169.254.169.254", "fd00:ec2::254", "100.100.100.200"}


def test_name_rules_match_names_and_their_ports_but_never_link_local() -> None:
    policy = PrefillPolicy(parse_allow_list("prefill.llm.svc:8000,*.pool.svc:*"))
    assert policy.allows_name("prefill.llm.svc", 8000) and not policy.allows_name("prefill.llm.svc", 8001)
    assert policy.allows_name("a.pool.svc", 5) and not policy.allows_name("pool.svc", 5)
    assert first_allowed(policy, [ip("169.254.1.1"), ip("10.0.0.7")], 8000, name_allowed=True) == ip("10.0.0.7")
    assert first_allowed(policy, [ip("169.254.1.1")], 8000, name_allowed=True) is None


@pytest.mark.parametrize("bad", ["10.0.0.0/8", "10.0.0.1/8:80", "10.0.0.0/8:0", "10.0.0.0/8:9-1", "[fd00::/8:*",
                                 "bad_name:80", "10.0.0.0/8:x", ":80"])
def test_bad_rules_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_allow_list(bad)


def test_describe_round_trips() -> None:
    text = "10.0.0.0/8:8000-8999,[fd00::]/8:*,prefill.llm.svc:8000"
    assert describe(parse_allow_list(text)) == text
