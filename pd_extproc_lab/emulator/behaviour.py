"""Scripted misbehaviour, typed: each emulator declares its ``Behaviour`` fields, and a script entry
with a key it does not know (a typo) or a value of the wrong type is refused with a 400 when it is
posted, instead of silently running the happy path.

The fields every emulator shares are here; ``common.misbehave`` acts on them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

B = TypeVar("B", bound="Behaviour")


class BehaviourError(ValueError):
    """A script entry this emulator cannot run; the message names the key."""


def _accepts(annotation: Any, value: Any) -> bool:
    if annotation is Any:
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_accepts(option, value) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation) or annotation
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


@dataclass(frozen=True, kw_only=True)
class Behaviour:
    delay: float | None = None  # seconds before anything else
    hang: bool = False  # never answer
    hold: bool = False  # wait until a test posts /_emulator/release (a request in flight for as long as it needs)
    status: int | None = None  # answer this error status in the engine's own error shape
    close: bool = False  # drop the connection at once

    @classmethod
    def parse(cls: type[B], raw: object) -> B:
        if not isinstance(raw, Mapping):
            raise BehaviourError("a behaviour is a JSON object")
        hints = typing.get_type_hints(cls)
        known = {field.name for field in dataclasses.fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise BehaviourError(f"unknown behaviour {key!r} for {cls.__name__} "
                                     f"(known: {', '.join(sorted(known))})")
            if not _accepts(hints[key], value):
                raise BehaviourError(f"behaviour {key!r} takes {hints[key]}, not {value!r}")
        return cls(**raw)

    def given(self) -> dict[str, Any]:
        """The fields set to something other than their default (what a test scripted)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) != _default(field)}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
