"""The checks a model spec's chain form and its graph form share: one collector of problems, bounded echoes of
hostile values, and a layer's parameters against the layer table."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.layers import LAYERS, Param
from fedbroker.layers import check_param as check_value
from fedbroker.layers.base import MAX_WIDTH as MAX_WIDTH

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlist = _short.maxdict = _short.maxtuple = 6
_short.maxlevel = 3


def show(value: Any) -> str:
    """A bounded repr for error messages: a hostile value is never echoed back in full."""
    return _short.repr(value)


class Collector:
    """Every problem of a spec, gathered so that one submission names them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, field_name: str, problem: str) -> None:
        """Note one problem at its full path."""
        self.errors.append(ConfigError(field_name, problem))

    def raise_if_any(self) -> None:
        """One ConfigError, several as ConfigErrors, or nothing."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, never a width to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_param(errors: Collector, where: str, param: Param, value: Any) -> Any:
    """One parameter's value against its kind's range (the layer table's check; the value as kept, a problem
    collected at `where`)."""
    value, problems = check_value(param, value, show)
    for suffix, problem in problems:
        errors.add(f"{where}{suffix}", problem)
    return value


def check_whole(errors: Collector, at: str, kind: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of a layer type that checks them as a whole (a library architecture), problems collected
    at `at.<name>`."""
    check = LAYERS[kind].check_params
    assert check is not None
    params, problems = check(raw)
    for key, problem in problems:
        errors.add(f"{at}.{key}", problem)
    return params


def layer_params(errors: Collector, at: str, kind: str, raw: Mapping[str, Any],
                 *, skip: frozenset[str] = frozenset({"type"}), later: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A layer's parameters from `raw` (its keys but `skip`), each checked and defaulted by the layer table;
    unknown and missing parameters are collected at `at.<name>`. `later` names parameters a block instance
    gives (checked then, by `check_param`). `kind` must be in LAYERS."""
    if LAYERS[kind].check_params is not None:  # a library architecture: checked whole, once its values are known
        given = {k: v for k, v in raw.items() if k not in skip}
        return given if later else check_whole(errors, at, kind, given)
    allowed = LAYERS[kind].params
    params: dict[str, Any] = {}
    for key in sorted((set(raw) | later) - skip - set(allowed)):
        errors.add(f"{at}.{key}", f"unknown parameter for {kind}; allowed: {', '.join(allowed) or 'none'}")
    for key, param in allowed.items():
        if key in later:
            continue
        if key not in raw or (raw[key] is None and param.required):
            if param.required:  # None stands for "the default" (a pool's stride), never for a value
                errors.add(f"{at}.{key}", f"is required for {kind}")
                continue
            params[key] = param.default
        else:
            params[key] = check_param(errors, f"{at}.{key}", param, raw[key])
    return params
