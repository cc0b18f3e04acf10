"""Reasoning parsers by name, as `--reasoning-parser NAME` picks them (vLLM's names), imported when named."""

from __future__ import annotations

from raytp.openai.plugins import PluginTable
from raytp.openai.reasoning.base import ReasoningParser, ReasoningStream, Split

__all__ = ["ReasoningParser", "ReasoningStream", "Split", "get_reasoning_parser", "reasoning_parser_names"]

_PARSERS: PluginTable[ReasoningParser] = PluginTable(
    "reasoning parser",
    {
        "deepseek_r1": ("raytp.openai.reasoning.deepseek_r1", "DeepSeekR1ReasoningParser"),
        "qwen3": ("raytp.openai.reasoning.qwen3", "Qwen3ReasoningParser"),
    },
)


def reasoning_parser_names() -> list[str]:
    return _PARSERS.names()


def get_reasoning_parser(name: str) -> ReasoningParser:
    return _PARSERS.create(name)
