"""Registries of algorithms by name: jobs pick algorithms by these names, never by dotted class paths."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from fedbroker.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to an algorithm class whose keyword-only constructor validates its parameters.

    Raises on a duplicate registration and on an unknown name (listing the known ones), so a typo in a
    job is caught at submission, not in round 7.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def add(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} algorithm {name!r} is already registered")
            self._entries[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"aggregation.{self.kind}",
                f"unknown {self.kind} algorithm {name!r}; known: {', '.join(self.names())}",
            ) from None

    def create(self, name: str, params: Mapping[str, Any] | None = None) -> T:
        """Build the named algorithm; unknown or ill-typed parameters become a ConfigError naming them."""
        cls = self.get(name)
        params = dict(params or {})
        if dataclasses.is_dataclass(cls):
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(params) - known)
            if unknown:
                raise ConfigError(
                    f"aggregation.{self.kind}_params.{unknown[0]}",
                    f"unknown parameter for {self.kind} {name!r}; known: {', '.join(sorted(known)) or 'none'}",
                )
        required = sorted(p.name for p in inspect.signature(cls).parameters.values()
                          if p.default is inspect.Parameter.empty and p.name not in params
                          and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        if required:
            raise ConfigError(f"aggregation.{self.kind}_params.{required[0]}",
                              f"required for {self.kind} {name!r} ({', '.join(required)} must be given)")
        try:
            return cls(**params)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"aggregation.{self.kind}_params", f"{name}: {exc}") from exc
