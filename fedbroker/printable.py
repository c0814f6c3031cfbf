"""Text from another party made safe to store and to print: a site's log line, a refusal's reason.

A site is not trusted with the operator's terminal: a control character (an ANSI escape, a carriage return that
rewrites the line, a backspace) or an invisible formatting character (a bidirectional override that reorders what
is shown) in its text could hide or forge what an operator reads. Each one becomes U+FFFD, so that something was
there stays visible (a tab, line feed or carriage return becomes a space: one record stays one line), and the text
is cut to a length.
"""

from __future__ import annotations

import unicodedata

REPLACEMENT = "\ufffd"
# Unicode categories never shown as themselves: controls (C0, DEL, C1), formatting (bidi overrides, zero-width),
# line and paragraph separators, surrogates, private use and unassigned code points.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
_SPACES = frozenset("\t\n\r")


def printable(text: str, *, limit: int | None = None) -> str:
    """`text` with every hidden or control character replaced by U+FFFD, cut to `limit` characters (an ellipsis
    marks a cut)."""
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)] + "…"
    return "".join(" " if c in _SPACES else REPLACEMENT if unicodedata.category(c) in _HIDDEN else c for c in text)
