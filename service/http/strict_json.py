"""Strict JSON for request bodies: one reading that no other parser of the same bytes disagrees
with, and parse work bounded before the parse begins.

* Duplicate keys, NaN and Infinity and strings holding a lone UTF-16 surrogate are refused (400),
  and so is JSON nested deeper than the interpreter's recursion limit (a ``RecursionError``, which
  is not a ``ValueError``).
* ``values_at_most`` tells, at C speed and without building a Python object, whether a document
  holds at most a number of JSON values, so a body of millions of tiny elements is refused before
  the parse would build millions of objects.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from service.errors import BadRequest

_STRING = re.compile(rb'"[^"]*"?')
"""A JSON string of a document without escaped quotes (``_unescaped``): a run of anything but a
quote, at memchr's speed. Its closing quote is optional, so a string left open matches to the end
of the document and every match ends where the next search begins: with the quote required, each
failed match was tried again from the next quote inside it, in time quadratic in the document's
length (with the escapes in the pattern, 80 KB of ``\\"`` after the separators held the event
loop 34 s; and the regular expression engine steps through escapes one at a time, 1 s for 16 MB)."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A ``\\u`` escape of a UTF-16 surrogate: the only way a parsed string can hold one (a raw one is
not UTF-8, refused by ``utf8``). Searched for first, so only a document that has one is checked."""


def utf8(data: bytes, what: str) -> str:
    """``data`` as UTF-8 text, or 400 naming the first byte that is not (JSON on the wire is UTF-8;
    ``json.loads`` of bytes would also take UTF-16 and UTF-32)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{what}: not UTF-8 (byte {exc.start} is {data[exc.start : exc.start + 1]!r})") from None


def loads(text: str, what: str, *, unique_keys: bool = True) -> Any:
    """``text`` parsed, or 400 naming ``what`` and the fault (``unique_keys``: duplicate keys are
    refused too, at a Python call per object: bound the objects first)."""
    hooks: dict[str, Any] = {"object_pairs_hook": _unique_keys} if unique_keys else {}
    try:
        value = json.loads(text, parse_constant=_no_constant, **hooks)
        if _SURROGATE_ESCAPE.search(text):
            _check_unicode(value)
    except RecursionError:
        raise BadRequest(f"{what}: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, the hooks' refusals, a lone surrogate
        raise BadRequest(f"{what}: {exc}") from None
    return value


def _check_unicode(value: Any) -> None:
    """Refuse a string holding a lone surrogate (``"\\ud800"``): it is not Unicode text, other parsers
    replace it or refuse it, and echoed in an answer (a request's id) it cannot be encoded (a 500)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        lone = ascii(exc.object[exc.start : exc.end]).strip("'")
        raise ValueError(f"a string holds a lone UTF-16 surrogate ({lone}), which is not Unicode text") from None


def values_at_most(data: bytes, most: int, end: int | None = None) -> bool:
    """Whether the JSON document ``data[:end]`` holds at most ``most`` values, counted without
    parsing: a container's values are separated by commas, so values <= commas + containers + 1.
    The bytes are counted as they are first (inside strings too: an upper bound, at memchr's speed,
    in place); only a document over the bound by that count has its strings found (at most
    ``most`` + 1 of them: a document of more strings holds more than ``most`` / 2 values, refused
    as well) and their separators taken off, so a valid one is never refused for commas or brackets
    inside its strings. Linear in the document's length whatever it holds; copied only when it has
    backslashes (escapes are taken out first, so no quote found is inside a string)."""
    end = len(data) if end is None else end
    total = _separators(data, 0, end) + 1
    if total <= most:
        return True
    if data.find(b"\\", 0, end) >= 0:
        data = _unescaped(data[:end])
        end = len(data)  # the escapes taken out hold no separator: the count stands
    for found, string in enumerate(_STRING.finditer(data, 0, end)):
        if found == most:
            return False
        total -= _separators(data, string.start(), string.end())
    return total <= most


def _unescaped(data: bytes) -> bytes:
    """``data`` without its escaped backslashes and quotes, so no quote left is inside a string.
    In JSON a backslash is only inside a string, and begins a two-character escape (``\\u`` is
    followed by hex digits): taking out ``\\\\`` pairs from the left, then ``\\"``, removes exactly
    the escapes that could hide a quote."""
    return data.replace(b"\\\\", b"").replace(b'\\"', b"")


def _separators(data: bytes, start: int, end: int) -> int:
    return data.count(b",", start, end) + data.count(b"[", start, end) + data.count(b"{", start, end)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return result


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")
