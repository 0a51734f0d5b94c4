"""The x-prefiller-host-port header: strict parsing into a prefill target. Pure.

Accepted: exactly one value, ``host:port`` or ``[ipv6]:port``; host is an IPv4 address or a DNS
name; port 1-65535 in plain decimal. Refused: an absent-but-empty value, repeats, comma lists,
whitespace, userinfo, paths, queries, fragments, percent-encoding, zone ids, leading zeros in the
port. Nothing is tried: a refused value never opens a connection.

``PrefillTargets`` is the processor's parser: the same, remembering the targets of values it accepted.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from extproc.protocol.errors import Code, PdError
from extproc.protocol.lru import Lru
from extproc.protocol.transport import WorkerAddress

HEADER = "x-prefiller-host-port"

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}\.?")
_PORT = re.compile(r"[1-9][0-9]{0,4}")
ACCEPTED_ENTRIES = 1024  # accepted values remembered at most (least recently used dropped first)


def parse_prefill_target(values: Sequence[str]) -> WorkerAddress:
    """Parse the header's values (every occurrence, as received). Raises PdError(invalid_prefill_target)."""
    if len(values) != 1:
        raise PdError(Code.INVALID_PREFILL_TARGET)
    return _parse(values[0])


class PrefillTargets:
    """``parse_prefill_target`` remembering the (immutable) targets of the values it accepted: a decode pod
    sees the same few prefill workers again and again. Refused values are parsed, and refused, every
    time. One per processor."""

    def __init__(self, entries: int = ACCEPTED_ENTRIES) -> None:
        self.accepted: Lru[str, WorkerAddress] = Lru(entries)

    def parse(self, values: Sequence[str]) -> WorkerAddress:
        remembered = self.accepted.get(values[0]) if len(values) == 1 else None
        if remembered is not None:
            return remembered
        target = parse_prefill_target(values)  # the one rule; it refuses anything but one value
        self.accepted.put(values[0], target)
        return target


def _parse(value: str) -> WorkerAddress:
    if not value or len(value) > 300 or not value.isascii():
        raise PdError(Code.INVALID_PREFILL_TARGET)
    host_text, sep, port_text = value.rpartition(":")
    if not sep or not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        raise PdError(Code.INVALID_PREFILL_TARGET)
    port = int(port_text)
    if host_text.startswith("[") and host_text.endswith("]"):
        try:
            ip6 = ipaddress.IPv6Address(host_text[1:-1])
        except ValueError:
            raise PdError(Code.INVALID_PREFILL_TARGET) from None
        if ip6.scope_id is not None:
            raise PdError(Code.INVALID_PREFILL_TARGET)
        return WorkerAddress(host=str(ip6), port=port, ip=ip6)
    if re.fullmatch(r"[0-9.]+", host_text):
        try:
            ip4 = ipaddress.IPv4Address(host_text)
        except ValueError:
            raise PdError(Code.INVALID_PREFILL_TARGET) from None
        return WorkerAddress(host=str(ip4), port=port, ip=ip4)
    if len(host_text) > 253 or not _NAME.fullmatch(host_text):
        raise PdError(Code.INVALID_PREFILL_TARGET)
    return WorkerAddress(host=host_text.rstrip(".").lower(), port=port, ip=None)
