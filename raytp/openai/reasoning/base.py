"""What every reasoning parser is: a pure function from the text so far to (reasoning, content).

Like the tool-call parsers (`raytp/openai/tool_parsers/base.py`), a reasoning parser answers for any
prefix of the output, and for a prefix p of t, each part of parse(p, False) is a prefix of the same
part of parse(t, final): the stream sends what grew, so streaming and whole-text agree by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

from raytp.openai.tool_parsers.base import held_suffix


class Split(NamedTuple):
    reasoning: str
    content: str


class ReasoningParser(ABC):
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"  # the end-of-reasoning marker a constraint waits for

    @abstractmethod
    def parse(self, text: str, final: bool) -> Split: ...

    def _after_start(self, text: str, i: int, final: bool) -> Split:
        """text[i:] is reasoning up to the end marker, content after it."""
        close = text.find(self.end, i)
        if close >= 0:
            return Split(text[i:close], text[close + len(self.end) :])
        if final:
            return Split(text[i:], "")
        return Split(text[i : len(text) - held_suffix(text, self.end)], "")


class ReasoningStream:
    """Text deltas -> `{"reasoning_content": ...}` deltas and the content text that grew (for the tool parser)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = Split("", "")

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content)."""
        self._text += text
        split = self.parser.parse(self._text, final)
        new = Split(split.reasoning[len(self._sent.reasoning) :], split.content[len(self._sent.content) :])
        self._sent = split
        return new
