"""One chat sample's text -> what the assistant message says: reasoning, content, tool calls.

`SampleParser` takes the sample's text deltas and returns OpenAI chat deltas (`reasoning_content`,
`content`, `tool_calls` entries). A non-streamed response is the same parser fed the whole text at
once, folded by `fold`: both roads run the same code, and the parsers' prefix invariant
(`tool_parsers/base.py`) makes the streamed deltas add up to the whole-text message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raytp.openai.reasoning import ReasoningParser, ReasoningStream
from raytp.openai.tool_parsers import ToolCallStream, ToolParser


class SampleParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None) -> None:
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._tools = ToolCallStream(tools, max_calls) if tools is not None else None

    @property
    def plain(self) -> bool:
        """No reasoning or tool parser: every token's text is content as it comes."""
        return self._reasoning is None and self._tools is None

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and self._tools.has_tool_calls

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self._tools is not None:
            out.extend(self._tools.feed(content, final))
        elif content:
            out.append({"content": content})
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A sample that stopped by itself after calling tools finished for `tool_calls`."""
        return "tool_calls" if engine_reason == "stop" and self.has_tool_calls else engine_reason


@dataclass
class Message:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape, arguments as JSON text


def fold(deltas: list[dict[str, Any]]) -> Message:
    """The message that a sequence of chat deltas adds up to (what a client's stream accumulator builds)."""
    reasoning, content = "", ""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", ()):
            if entry["index"] == len(calls):
                calls.append({"id": entry["id"], "type": "function", "function": dict(entry["function"])})
            else:
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return Message(reasoning or None, content if content or not calls else None, calls)
