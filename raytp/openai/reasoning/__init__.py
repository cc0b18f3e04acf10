"""Reasoning parsers by name, as `--reasoning-parser NAME` picks them (vLLM's names), imported when named."""

from __future__ import annotations

from raytp.openai.plugins import PluginTable
from raytp.openai.reasoning.base import ReasoningParser, ReasoningStream, Split

__all__ = ["ReasoningParser", "ReasoningStream", "Split", "REASONING_PARSERS"]

REASONING_PARSERS: PluginTable[ReasoningParser] = PluginTable(
    "reasoning parser",
    {
        "deepseek_r1": ("raytp.openai.reasoning.deepseek_r1", "DeepSeekR1ReasoningParser"),
        "qwen3": ("raytp.openai.reasoning.qwen3", "Qwen3ReasoningParser"),
    },
)

