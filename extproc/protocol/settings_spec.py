"""How a setting is declared: its name, parser, help and how it is shown. Core settings (config.py) and
each engine's own settings (its ``Engine.settings``) are declared the same way; this module imports
nothing of the project's but units, so engines can declare settings without importing config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.protocol.units import format_duration, parse_duration, parse_size

ENV_PREFIX = "PD_EXTPROC_"


def show_plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_duration(value)
    return str(value)


@dataclass(frozen=True, slots=True)
class SettingSpec:
    name: str
    parse: Callable[[str], Any]
    help: str
    show: Callable[[Any], str] = show_plain
    default: Any = None  # engine settings only: core settings take theirs from the Settings dataclass

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if value not in options:
            raise ValueError("expected one of " + ", ".join(options))
        return value

    return parse


def positive_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError("expected a duration above zero")
    return value


def positive_size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise ValueError("expected a size above zero")
    return value


def text_value(text: str) -> str:
    return text.strip()


def existing_file(text: str) -> str:
    """A path that exists (empty = unset)."""
    path = text.strip()
    if path and not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    return path


class SecretFileError(ValueError):
    """A secret file cannot be used; the message names the file, never its content."""


def read_secret_file(path: str) -> bytes:
    """A shared key from a file: its bytes, without one trailing newline; never empty. The content is
    never logged or shown (settings show the path only)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(64 << 10)
    except OSError as exc:
        raise SecretFileError(f"cannot read {path}: {exc.strerror}") from None
    if data.endswith(b"\n"):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    if not data:
        raise SecretFileError(f"{path} is empty")
    return data


def read_token_file(path: str) -> bytes:
    """A secret that travels in an HTTP header (``Authorization: Bearer <token>``): visible ASCII only."""
    token = read_secret_file(path)
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise SecretFileError(f"{path} must hold one token of visible ASCII characters (no spaces)")
    return token
