"""Text from another party made safe to store and to print: a site's log line, a refusal's reason.

A site is not trusted with the operator's terminal: a control character (an ANSI escape, a carriage return that
rewrites the line, a backspace) or an invisible formatting character (a bidirectional override that reorders what
is shown) in its text could hide or forge what an operator reads. Each one becomes U+FFFD, so that something was
there stays visible (a tab, line feed or carriage return becomes a space: one record stays one line), and the text
is cut to a length.
"""

from __future__ import annotations

import unicodedata
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

REPLACEMENT = "\ufffd"
# Unicode categories never shown as themselves: controls (C0, DEL, C1), formatting (bidi overrides, zero-width),
# line and paragraph separators, surrogates, private use and unassigned code points.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
_SPACES = frozenset("\t\n\r")
M = TypeVar("M", bound=Message)


def printable(text: str, *, limit: int | None = None) -> str:
    """`text` with every hidden or control character replaced by U+FFFD, cut to `limit` characters (an ellipsis
    marks a cut)."""
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return "".join(" " if c in _SPACES else REPLACEMENT if unicodedata.category(c) in _HIDDEN else c for c in text)



def printable_fields(message: M, *, limit: int) -> M:
    """`message` (changed in place, and returned) with every string it holds, in nested messages, repeated
    fields and maps too, made `printable` and cut to `limit`: what another party sent, made safe in one step
    where it enters, whichever field a later version adds."""
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            _printable_map(field.message_type, value, limit=limit)
        elif field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                value[:] = [printable(v, limit=limit) for v in value]
            else:
                setattr(message, field.name, printable(value, limit=limit))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value if field.is_repeated else (value,):
                printable_fields(item, limit=limit)
    return message


def _printable_map(entry: Descriptor, entries: Any, *, limit: int) -> None:
    """A map's string keys and values, and its message values' strings (keys may change: the map is rebuilt)."""
    nested = entry.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE
    items = []
    for key, value in entries.items():
        if nested:
            copy = type(value)()
            copy.CopyFrom(value)
            value = printable_fields(copy, limit=limit)
        elif isinstance(value, str):
            value = printable(value, limit=limit)
        items.append((printable(key, limit=limit) if isinstance(key, str) else key, value))
    entries.clear()
    for key, value in items:
        if nested:
            entries[key].CopyFrom(value)
        else:
            entries[key] = value
