"""Named things chosen by configuration (sources, environments, dialects, rewards, backends...).

Every registry is a `Registry`: a read-only mapping of name -> entry with one error for a name it
does not hold, `UnknownName`, whose message lists the known names. `UnknownName` is a KeyError
(it is a failed lookup) and a ValueError (it is a bad setting), so callers that catch either keep
working. Adding an entry is one line: `REGISTRY.register("name", entry)`, or `@REGISTRY.register("name")`
on a class or function.
"""
from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no registry entry has: "unknown <kind> 'x'; known: a, b, c"."""

    def __init__(self, kind: str, name, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError would show the message quoted
        return self.args[0]


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in registration order; `registry[name]` raises `UnknownName`."""

    def __init__(self, kind: str, entries: Mapping[str, T] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = dict(entries or {})

    def register(self, name: str, entry: T | None = None):
        """Add `entry` under `name` (a second entry under one name is a mistake: ValueError).
        Without `entry`, a decorator that registers what it decorates."""
        if entry is None:
            def decorate(obj: T) -> T:
                self.register(name, obj)
                return obj
            return decorate
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name, as a YAML list would give
            raise UnknownName(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        """The known names, sorted (as error messages and help texts show them)."""
        return sorted(self._entries)

    def check(self, names) -> None:
        """Raise `UnknownName` for the first of `names` that is not registered."""
        for name in names:
            self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    # The dict's own views: `Mapping`'s generic ones go through `__getitem__` per entry, and the
    # build walks registries (dialects, negative makers) for every turn and record.
    def keys(self) -> KeysView[str]:
        return self._entries.keys()

    def values(self) -> ValuesView[T]:
        return self._entries.values()

    def items(self) -> ItemsView[str, T]:
        return self._entries.items()

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
