"""Tool-call parsers by name, as `--tool-call-parser NAME` picks them (vLLM's ToolParserManager names).

Each parser lives in its own module, imported only when named. Adding one is a module with a
`ToolParser` subclass and one row in `TOOL_PARSERS`.
"""

from __future__ import annotations

from raytp.openai.plugins import PluginTable
from raytp.openai.tool_parsers.base import CallSnapshot, Snapshot, ToolCallStream, ToolParser

__all__ = ["CallSnapshot", "Snapshot", "ToolCallStream", "ToolParser", "TOOL_PARSERS"]

TOOL_PARSERS: PluginTable[ToolParser] = PluginTable(
    "tool-call parser",
    {
        "hermes": ("raytp.openai.tool_parsers.hermes", "HermesToolParser"),
        "llama3_json": ("raytp.openai.tool_parsers.llama3_json", "Llama3JsonToolParser"),
        "mistral": ("raytp.openai.tool_parsers.mistral", "MistralToolParser"),
    },
)

