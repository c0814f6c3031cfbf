"""The implementations of each kind of algorithm, bound to the kernel catalogue's names (`fedbroker.algorithms.catalogue`).

An implementation extends its name's parameter class with the arithmetic (`FedDNA(FedDNAParams)`), so the
kernel's checks are the whole check and a job the coordinator accepted builds here. Binding a name twice,
a name the catalogue does not know, or a class that is not its parameters' raises at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from fedbroker.algorithms.catalogue import Catalogue, Choice

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps each name of a catalogue to the class that implements it."""

    def __init__(self, catalogue: Catalogue[Any]) -> None:
        self.catalogue = catalogue
        self.kind = catalogue.kind
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Bind `name` to the decorated class."""

        def add(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} algorithm {name!r} is already registered")
            if name not in self.catalogue.names():
                raise ValueError(f"{self.kind} algorithm {name!r} is not in the catalogue (fedbroker.algorithms.catalogue)")
            params = self.catalogue.entry(name).params
            if not issubclass(cls, params):
                raise TypeError(f"{self.kind} {name!r}: {cls.__name__} must extend {params.__name__}")
            self._entries[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        """The bound names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """The class bound to `name`; an unknown name is the catalogue's ConfigError, listing the known ones."""
        self.catalogue.entry(name)
        return self._entries[name]

    def build(self, choice: Choice[Any]) -> T:
        """The implementation of a checked choice, with its parameters."""
        values = {f.name: getattr(choice.params, f.name) for f in dataclasses.fields(choice.params) if f.init}
        return self.get(choice.name)(**values)

    def create(self, name: str, params: Mapping[str, Any] | None = None) -> T:
        """Build the named algorithm; unknown or ill-typed parameters become a ConfigError naming them."""
        return self.build(self.catalogue.choose(name, params))
