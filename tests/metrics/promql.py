"""Which series and labels a PromQL expression names (enough PromQL for our generated queries).

Used to prove statically that every dashboard and alert expression names only series the
registry exports (or Ray Serve's known ones), and only labels those series carry.
"""

from __future__ import annotations

import re

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(rf"({_NAME})\s*\{{([^}}]*)\}}")
_MATCHER = re.compile(rf"({_NAME})\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
# Words that read like names but are operators or modifiers.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}


def _strip_strings(expr: str) -> str:
    return _STRING.sub('""', expr)


def series_names(expr: str) -> set[str]:
    """The metric names an expression selects (function names and keywords excluded)."""
    s = re.sub(r"\{[^}]*\}", " ", _strip_strings(expr))
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = _GROUPING.sub(" ", s)
    names = set()
    for m in re.finditer(rf"(?<![\w.$]){_NAME}", s):
        word = m.group(0)
        rest = s[m.end() :].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def matcher_labels(expr: str) -> dict[str, set[str]]:
    """series name -> the labels its `{...}` selector matches on (label values must not hold '}')."""
    out: dict[str, set[str]] = {}
    for name, body in _MATCHERS.findall(expr):
        out.setdefault(name, set()).update(_MATCHER.findall(_strip_strings(body)))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by (...), without (...), on (...) and the like."""
    return {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def variables(expr: str) -> set[str]:
    """Grafana variables ($name) the expression uses."""
    return set(re.findall(r"\$(\w+)", expr))
