"""A read-only, hashable mapping, so that whole allocator states can sit in a set.

Not a general-purpose container: it exists because ``types.MappingProxyType`` is not
hashable and a state must be.
"""

from collections.abc import Iterator, Mapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """An immutable mapping; equal maps hash equal whatever their insertion order."""

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[K, V] | None = None) -> None:
        self._items: dict[K, V] = dict(items) if items is not None else {}
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self._items == other._items
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def set(self, key: K, value: V) -> "FrozenMap[K, V]":
        """A copy with ``key`` bound to ``value``."""
        items = dict(self._items)
        items[key] = value
        return FrozenMap(items)

    def delete(self, key: K) -> "FrozenMap[K, V]":
        """A copy without ``key``; ``KeyError`` if it is absent."""
        items = dict(self._items)
        del items[key]
        return FrozenMap(items)
