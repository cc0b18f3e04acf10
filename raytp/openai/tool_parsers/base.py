"""What every tool-call parser is: a pure function from the text so far to a `Snapshot`.

A parser answers `parse(text, final)` for any prefix of a model's output. Streaming and whole-text
extraction are the same computation: the stream (`ToolCallStream`) re-parses the text it has and sends
what grew since the last snapshot; the whole text is one final parse. That holds only because every
parser keeps this invariant, which the tests check over every split of sample outputs:

    for a prefix p of t, parse(p, False) is a prefix of parse(t, final) field by field: its content is
    a prefix of the longer content, its calls are the first calls of the longer list, each with the
    same name (once known) and arguments text that is a prefix of the longer arguments.

So a parser holds back any text that may still turn out to be markup (the start of a tool-call tag,
whitespace before one) and reports a call only from its name on. Arguments are the model's own JSON
text of the arguments value, never a re-serialization of a partial parse: a partial parse completes a
value differently as more arrives (a number `1` may become `12`), so its text is not a stable prefix.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from raytp.openai.tool_parsers.json_scan import Scan, scan_members, skip_ws


@dataclass
class CallSnapshot:
    name: str | None  # None until the name's JSON string is complete
    arguments: str  # the arguments value's JSON text, as far as it has arrived


@dataclass
class Snapshot:
    content: str
    calls: list[CallSnapshot] = field(default_factory=list)


class ToolParser(ABC):
    # The tool-call markup is made of special tokens the detokenizer would drop (mistral's [TOOL_CALLS]).
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> Snapshot:
        """`final`: the text is the whole output. Keeps the prefix invariant in the module docstring."""

    def structural_tag(self, schemas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        """A structural tag (vLLM's `{"structures", "triggers"}`) under which every call this parser reads
        has arguments valid for its function's schema (`schemas`: name -> JSON schema), or None when
        the format cannot be written as one."""
        return None

    def make_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def plain_text(segment: str, final: bool, after_call: bool, tag: str) -> str:
    """The content of text outside tool-call markup at the end of the output so far. Whitespace right
    before a tool call and whitespace-only text after the last call are not content; until the output
    ends, a possible start of `tag` and the whitespace before it are held back."""
    if not final:
        segment = segment[: len(segment) - held_suffix(segment, tag)].rstrip()
    return "" if after_call and not segment.strip() else segment


def _json_string(literal: str) -> str | None:
    """The string a quoted literal stands for; None for a bad escape or a raw control character."""
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class Found(NamedTuple):
    call: CallSnapshot | None  # None when the object is over (complete or broken) without a name
    scan: Scan  # of the object: complete, broken (at scan.end), or still arriving

    def arriving(self, text: str) -> bool:
        return not self.scan.complete and not self.scan.broken(text)


def call_at(text: str, i: int, final: bool, arg_keys: tuple[str, ...]) -> Found:
    """The `{"name": ..., <one of arg_keys>: ...}` object at text[i] ('{')."""
    members = scan_members(text, i, final)
    name: str | None = None
    if "name" in members.values:
        start, scan = members.values["name"]
        if scan.complete and text[start] == '"':
            name = _json_string(text[start : scan.end])
    arguments = ""
    # The first arguments key in the object wins (a later duplicate must not replace what was streamed).
    for key, (start, scan) in members.values.items():
        if key in arg_keys:
            arguments = text[start : scan.end]
            break
    else:
        if members.scan.complete:  # a call without arguments: OpenAI's arguments are an object's JSON
            arguments = "{}"
    found = Found(CallSnapshot(name, arguments), members.scan)
    return found if name is not None or found.arriving(text) else Found(None, members.scan)


def calls_in_array(text: str, i: int, final: bool, arg_keys: tuple[str, ...]) -> tuple[list[CallSnapshot], int | None]:
    """The call objects of the JSON array at text[i] ('['): (calls, where the array ends or None)."""
    calls: list[CallSnapshot] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "]":
        return calls, j + 1
    while j < len(text) and text[j] == "{":
        found = call_at(text, j, final, arg_keys)
        if found.call is not None:
            calls.append(found.call)
        if not found.scan.complete:
            return calls, None
        j = skip_ws(text, found.scan.end)
        if j < len(text) and text[j] == "]":
            return calls, j + 1
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        break
    return calls, None


@dataclass
class _SentCall:
    id: str
    arguments: int  # characters of the arguments already sent


class ToolCallStream:
    """Turns text deltas into OpenAI chat deltas: `{"content": ...}` and `{"tool_calls": [...]}` (a call's
    id, type and name first with empty arguments, then argument fragments). `max_calls` (1 when
    parallel_tool_calls is false) drops every call after the first ones, streamed or not."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self._text = ""
        self._content = 0  # characters of content already sent
        self._calls: list[_SentCall] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Re-parses all the text so far (O(length) per delta: cheap next to the step that made the text)."""
        if not text and not final:
            return []
        self._text += text
        snap = self.parser.parse(self._text, final)
        out: list[dict[str, Any]] = []
        if len(snap.content) > self._content:
            out.append({"content": snap.content[self._content :]})
            self._content = len(snap.content)
        calls = snap.calls if self.max_calls is None else snap.calls[: self.max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self._calls):
                self._calls.append(_SentCall(self.parser.make_id(), 0))
                header = {"index": index, "id": self._calls[index].id, "type": "function"}
                out.append({"tool_calls": [{**header, "function": {"name": call.name, "arguments": ""}}]})
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments:
                fragment = call.arguments[sent.arguments :]
                out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                sent.arguments = len(call.arguments)
        return out
