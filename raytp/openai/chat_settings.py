"""How a server answers chat requests beyond the request itself: vLLM's `--enable-auto-tool-choice`,
`--tool-call-parser NAME` and `--reasoning-parser NAME`, for the chat handler of the HTTP server and of
batch jobs alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from raytp.openai.reasoning import ReasoningParser, get_reasoning_parser, reasoning_parser_names
from raytp.openai.tool_parsers import tool_parser_names


@dataclass(frozen=True)
class ChatSettings:
    # tool_choice "auto" (and tools without tool_choice) parses calls out of free text; off, it is a 400
    enable_auto_tool_choice: bool = field(
        default=False, metadata={"help": "tool_choice auto: parse tool calls out of the text (needs a parser)"}
    )
    tool_call_parser: str | None = field(
        default=None, metadata={"help": "the tool-call format of the model's output", "choices": tool_parser_names()}
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={"help": "split reasoning_content out of the output", "choices": reasoning_parser_names()},
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in tool_parser_names():
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}; registered: {', '.join(tool_parser_names())}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning_parser_names():
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; registered: {', '.join(reasoning_parser_names())}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (vLLM's --tool-call-parser).")

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def reasoning(self) -> ReasoningParser | None:
        return get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser is not None else None
