"""A bounded map that drops its least recently used entry: the per-owner caches of the request path. Pure.

Each cache is an instance its owner holds (an owner app.py builds), never module state: two servers,
or two tests, never share one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    def __init__(self, entries: int) -> None:
        if entries < 1:
            raise ValueError("an LRU cache holds at least one entry")
        self._entries = entries
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value, now the most recently used; None if absent."""
        try:
            self._items.move_to_end(key)
        except KeyError:
            return None
        return self._items[key]

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` as the most recently used; past the bound the least recently used goes."""
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self._entries:
            self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
