"""Worker-supplied text made safe for a log line (issue 23 item 12).

A release reason, a profile name, a lease id or a reward's error message quoting a
completion all come from a worker. Logged raw, a newline or a carriage return in one would
start a forged log line ("...\\nWARNING controller: worker w-1 quarantined"), and terminal
escapes could rewrite what an operator sees. `log_safe` escapes every control character
(C0, DEL, C1) and the Unicode line and paragraph separators the way `repr` does, keeps the
rest (printable text, non-ASCII letters) as it is, and cuts the result to `limit`
characters, so plain text is unchanged.
"""

from __future__ import annotations

import unicodedata

_LINE_BREAKS = {"\u2028", "\u2029", "\x85"}


def _escape(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    if ch in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch]
    if ch in _LINE_BREAKS or unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
        code = ord(ch)
        if code < 0x100:
            return f"\\x{code:02x}"
        return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    return ch


def log_safe(text: object, limit: int = 200) -> str:
    """`text` as one printable line of at most `limit` characters (then '...')."""
    s = "".join(_escape(ch) for ch in str(text))
    return s if len(s) <= limit else s[: max(limit - 3, 0)] + "..."
