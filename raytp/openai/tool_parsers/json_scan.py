"""A prefix-tolerant JSON scanner: where a value ends, or how far it has got, in text still arriving.

Tool-call parsers run on every prefix of a model's output, so the scanner never raises: each `Scan`
says where the value ends (`complete`) or where scanning stopped, either at the end of the text (the
value is still arriving) or at the first character that cannot continue it (`broken`). The answer for
a prefix never contradicts the answer for a longer text: what a prefix reports complete stays complete
with the same span, and a broken value stays broken at the same place.

Containers are checked for matching brackets and string escapes only (their contents are not
validated): a tool call's arguments are handed on as the model's own text.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

WHITESPACE = " \t\r\n"
_SCALAR_END = ",}]" + WHITESPACE
# The scanner runs over the text so far on every delta: strings and the search for structure run in `re`.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_STRUCTURE = re.compile(r'[\[\]{}"]')


class Scan(NamedTuple):
    end: int  # just past the value when complete; otherwise where scanning stopped
    complete: bool

    def broken(self, text: str) -> bool:
        """Stopped before the end of the text: a character that cannot continue the value."""
        return not self.complete and self.end < len(text)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def scan_string(text: str, i: int) -> Scan:
    """text[i] is the opening quote."""
    m = _STRING.match(text, i)
    return Scan(m.end(), True) if m else Scan(len(text), False)


def scan_value(text: str, i: int, final: bool) -> Scan:
    """The value starting at text[i] (no leading whitespace). `final`: no more text will come, so a
    number or literal running to the end of the text is complete."""
    n = len(text)
    if i >= n:
        return Scan(n, False)
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        return _scan_container(text, i)
    j = i
    while j < n and text[j] not in _SCALAR_END:
        j += 1
    if j == i:  # a delimiter where a value should start
        return Scan(i, False)
    return Scan(j, j < n or final)


def _scan_container(text: str, i: int) -> Scan:
    closers: list[str] = []
    j = i
    while (m := _STRUCTURE.search(text, j)) is not None:
        j, c = m.start(), m.group()
        if c == '"':
            s = scan_string(text, j)
            if not s.complete:
                return s
            j = s.end
            continue
        if c in "{[":
            closers.append("}" if c == "{" else "]")
        else:
            if c != closers.pop():
                return Scan(j, False)
            if not closers:
                return Scan(j + 1, True)
        j += 1
    return Scan(len(text), False)


class Members(NamedTuple):
    """An object's members found so far: key -> (where its value starts, how its value scanned)."""

    values: dict[str, tuple[int, Scan]]
    scan: Scan  # of the object itself


def scan_members(text: str, i: int, final: bool) -> Members:
    """The members of the object whose `{` is text[i], as far as the text goes."""
    n = len(text)
    values: dict[str, tuple[int, Scan]] = {}
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return Members(values, Scan(j + 1, True))
    while True:
        if j >= n:
            return Members(values, Scan(n, False))
        if text[j] != '"':
            return Members(values, Scan(j, False))
        k = scan_string(text, j)
        if not k.complete:
            return Members(values, k)
        try:
            key = json.loads(text[j : k.end])
        except ValueError:  # a bad escape
            return Members(values, Scan(j, False))
        j = skip_ws(text, k.end)
        if j >= n or text[j] != ":":
            return Members(values, Scan(j, False))
        j = skip_ws(text, j + 1)
        v = scan_value(text, j, final)
        if j < n:
            values.setdefault(key, (j, v))  # a duplicate key cannot change what an earlier prefix reported
        if not v.complete:
            return Members(values, Scan(v.end, False))
        j = skip_ws(text, v.end)
        if j < n and text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if j < n and text[j] == "}":
            return Members(values, Scan(j + 1, True))
        return Members(values, Scan(j, False))
