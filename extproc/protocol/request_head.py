"""What we know of an HTTP request before its body: the path (with its query) and every header. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What we know of the HTTP request before its body: path (with query) and headers."""

    path: str
    headers: tuple[tuple[str, str], ...]  # lower-case names, every occurrence, in order

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]

    def first(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None
