"""How a server answers chat requests beyond the request itself: vLLM's `--enable-auto-tool-choice`,
`--tool-call-parser NAME` and `--reasoning-parser NAME`, for the chat handler of the HTTP server and of
batch jobs alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from raytp.openai.reasoning import REASONING_PARSERS, ReasoningParser
from raytp.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ChatSettings:
    # tool_choice "auto" (and tools without tool_choice) parses calls out of free text; off, it is a 400
    enable_auto_tool_choice: bool = field(
        default=False, metadata={"help": "tool_choice auto: parse tool calls out of the text (needs a parser)"}
    )
    tool_call_parser: str | None = field(
        default=None, metadata={"help": "the tool-call format of the model's output", "choices": TOOL_PARSERS.names()}
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={"help": "split reasoning_content out of the output", "choices": REASONING_PARSERS.names()},
    )

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            TOOL_PARSERS.check(self.tool_call_parser)
        if self.reasoning_parser is not None:
            REASONING_PARSERS.check(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (vLLM's --tool-call-parser).")

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def reasoning(self) -> ReasoningParser | None:
        return REASONING_PARSERS.create(self.reasoning_parser) if self.reasoning_parser is not None else None
