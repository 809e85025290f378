"""Quarantine rows: what a dropped input record was, where it came from, and why it was dropped.

Any stage that drops a record makes its row here, so the raw text is cut and made storable the same
way whichever stage it was.
"""
from __future__ import annotations

import json

# Raw input kept in the quarantine is cut to this many characters (a 10 MB string stays traceable
# without bloating the quarantine).
MAX_QUARANTINE_RAW = 100_000


def shown(value) -> str:
    """A value as JSON text for the quarantine; never fails, whatever the value holds."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
        text.encode("utf-8")
    except (RecursionError, ValueError, TypeError, UnicodeEncodeError):
        # Too deep for the encoder, or text no UTF-8 file can hold: show it escaped.
        text = ascii(value) if _depth_at_most(value, 200) else f"<{type(value).__name__} nested too deep to show>"
    return text


def _depth_at_most(value, limit: int) -> bool:
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _storable(text: str | None) -> str | None:
    """Text Arrow can store: an unpaired surrogate (from an exception message, say) escaped."""
    if text is None or text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def quarantine_entry(source: str, source_file: str, index: int, source_id: str | None, reason: str,
                     detail: str, raw: str | None) -> dict:
    if raw is not None and len(raw) > MAX_QUARANTINE_RAW:
        raw = raw[:MAX_QUARANTINE_RAW] + "...[cut]"
    return {"source": source, "source_file": source_file, "index": index, "source_id": _storable(source_id),
            "reason": reason, "detail": _storable(detail), "raw": _storable(raw)}
