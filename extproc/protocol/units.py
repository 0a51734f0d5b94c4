"""Parsing of the value syntaxes settings use: durations, byte sizes, listen addresses."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DURATION = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h)")
_DURATION_FACTOR = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"(?P<num>\d+)(?P<unit>|B|KiB|MiB|GiB)")
_SIZE_FACTOR = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_duration(text: str) -> float:
    """``"250ms"``, ``"5s"``, ``"1.5m"``, ``"1h"`` -> seconds. A unit is required."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError("expected a duration such as 500ms, 5s, 2m or 1h")
    return float(match["num"]) * _DURATION_FACTOR[match["unit"]]


def format_duration(seconds: float) -> str:
    """Seconds as a protobuf-JSON duration (what Envoy accepts): ``"0.25s"``."""
    millis = round(seconds * 1000)
    whole, frac = divmod(millis, 1000)
    return f"{whole}s" if frac == 0 else f"{whole}.{frac:03d}s"


def parse_size(text: str) -> int:
    """``"1048576"``, ``"512KiB"``, ``"32MiB"``, ``"1GiB"`` -> bytes."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError("expected a size such as 1048576, 512KiB, 32MiB or 1GiB")
    return int(match["num"]) * _SIZE_FACTOR[match["unit"]]


@dataclass(frozen=True, slots=True)
class Address:
    """A listen or connect address: TCP ``host:port`` or a Unix socket path."""

    host: str
    port: int
    unix_path: str | None = None

    @property
    def is_unix(self) -> bool:
        return self.unix_path is not None

    def grpc_target(self) -> str:
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.grpc_target()


_HOSTPORT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.\-]+)):(?P<port>\d{1,5})")


def parse_address(text: str, *, allow_unix: bool = False, allow_port_zero: bool = False) -> Address:
    """``127.0.0.1:8000``, ``[::1]:8000``, ``localhost:8000`` or (if allowed) ``unix:/path``."""
    text = text.strip()
    if text.startswith("unix:"):
        if not allow_unix:
            raise ValueError("a Unix socket is not allowed here")
        path = text[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError("a Unix socket path must be absolute")
        return Address(host="", port=0, unix_path=path)
    match = _HOSTPORT.fullmatch(text)
    if match is None:
        raise ValueError("expected host:port or [ipv6]:port")
    port = int(match["port"])
    if port > 65535 or (port == 0 and not allow_port_zero):
        raise ValueError("port must be in 1-65535")
    return Address(host=match["v6"] or match["host"], port=port)
