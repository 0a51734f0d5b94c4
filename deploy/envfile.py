"""Reads the per-target settings files (envoy/pd-extproc.env, k8s/base/pd-extproc.env).

The same file is a Compose ``env_file`` and the input of the manifest generator, so it is kept to
the subset both read identically: ``NAME=value`` lines, ``#`` comment lines, blank lines. Quotes,
``$`` and ``#`` inside values are refused because Compose would interpret them.
"""

from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
_FORBIDDEN = ('"', "'", "$", "#", "`")


class EnvFileError(ValueError):
    """A settings file line that Compose and the generator would not read the same way."""


def parse_env_text(text: str, source: str = "<text>") -> dict[str, str]:
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        where = f"{source}:{number}"
        if not sep or not _NAME.fullmatch(name):
            raise EnvFileError(f"{where}: expected NAME=value")
        if any(mark in value for mark in _FORBIDDEN):
            raise EnvFileError(f"{where}: quotes, $, # and backticks are not allowed in values")
        if name in values:
            raise EnvFileError(f"{where}: {name} is set twice")
        values[name] = value.strip()
    return values


def read_env_file(path: Path) -> dict[str, str]:
    return parse_env_text(path.read_text(), str(path))
