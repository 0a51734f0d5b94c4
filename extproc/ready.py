"""The ``ready`` line: how a child process (our server, an emulated worker, ``pd-extproc up``) says it
is listening, and where. One format, written and parsed only here:

    ready key=value key=value ...

Values never contain spaces. The server says ``grpc=`` and ``metrics=``; an emulated worker ``url=``
and ``side_channel=``; ``up`` ``url=``, ``prefill=``, ``decode=``, ``metrics=`` and ``logs=``.
"""

from __future__ import annotations

PREFIX = "ready"


def format_line(**fields: object) -> str:
    parts = [PREFIX]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"ready field {key} must be a non-empty value without spaces: {text!r}")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def is_ready(line: str) -> bool:
    return line == PREFIX or line.startswith(PREFIX + " ")


def parse(line: str) -> dict[str, str]:
    """The fields of a ready line; ValueError for anything else."""
    words = line.split()
    if not words or words[0] != PREFIX:
        raise ValueError(f"not a ready line: {line!r}")
    fields: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"malformed ready field {word!r} in {line!r}")
        fields[key] = value
    return fields
