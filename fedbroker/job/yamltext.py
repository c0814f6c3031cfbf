"""YAML text read with bounded cost: the size is checked before the parser runs, and anchors cannot be
used to make a small text expensive.

PyYAML's safe loader builds no objects, but it still does unbounded work on hostile text: a chain of
merge keys (`b: &b {<<: *a, ...}`, `c: &c {<<: *b, ...}`, ...) copies every earlier mapping into every
later one (a 249 KB chain cost 52 s and 933 MB), and aliases can make a few KiB stand for billions of
nodes. Jobs and configuration files need neither beyond a handful, so `load_yaml` refuses a text over
its size limit before parsing, and counts aliases and merge keys while composing, refusing the text at
the first one over the bound: the parser never does more than a bounded amount of work per byte.
"""

from __future__ import annotations

from typing import Any

import yaml

from fedbroker.errors import ConfigError

MAX_ALIASES = 64      # `*name` references in one text (a merge's `<<: *name` counts as one)
MAX_MERGES = 16       # `<<` merge keys in one text
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """Internal: the text went over a bound; the message says which."""


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, counting aliases and merge keys as it composes nodes."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0
        self.merges = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Refused(f"uses more than {MAX_ALIASES} YAML aliases (*name); write the values out")
        return super().compose_node(parent, index)

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        self.merges += sum(1 for key, _ in node.value if key.tag == _MERGE_TAG)
        seen: set[str] = set()
        for key, _ in node.value:  # the safe loader keeps a repeated key's last value without a word
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                if key.value in seen:
                    mark = key.start_mark
                    raise _Refused(f"repeats the key {key.value[:80]!r} in one mapping (line {mark.line + 1}, "
                                   f"column {mark.column + 1}): each name may appear once")
                seen.add(key.value)
        if self.merges > MAX_MERGES:
            raise _Refused(f"uses more than {MAX_MERGES} YAML merge keys (<<); write the mappings out")
        return node


def load_yaml(text: str | bytes, *, where: str, max_bytes: int) -> Any:
    """Parse YAML (or JSON) text of at most `max_bytes` bytes with the safe loader and the bounds above;
    every refusal is a ConfigError on `where` saying why (size, aliases, merge keys, syntax, nesting)."""
    if len(text) > max_bytes or (isinstance(text, str) and len(text.encode("utf-8", "replace")) > max_bytes):
        raise ConfigError(where, f"is larger than {max_bytes} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(where, f"is not UTF-8 text: {exc}") from None
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses control characters already
        return loader.get_single_data()
    except _Refused as exc:
        raise ConfigError(where, str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(where, f"is not valid YAML/JSON: {str(exc)[:300]}") from None
    except ValueError as exc:  # a YAML timestamp that is no date (2024-02-30)
        raise ConfigError(where, f"is not valid YAML/JSON: {str(exc)[:300]}") from None
    except RecursionError:
        raise ConfigError(where, "nests deeper than the YAML parser can follow") from None
    finally:
        if loader is not None:
            loader.dispose()
