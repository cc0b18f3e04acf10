"""Reasoning parsers by name, as `--reasoning-parser NAME` picks them (vLLM's names), imported when named."""

from __future__ import annotations

import importlib

from raytp.openai.reasoning.base import ReasoningParser, ReasoningStream, Split

__all__ = ["ReasoningParser", "ReasoningStream", "Split", "get_reasoning_parser", "reasoning_parser_names"]

_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("raytp.openai.reasoning.deepseek_r1", "DeepSeekR1ReasoningParser"),
    "qwen3": ("raytp.openai.reasoning.qwen3", "Qwen3ReasoningParser"),
}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; registered: {', '.join(reasoning_parser_names())}")
    module, cls = _PARSERS[name]
    parser: ReasoningParser = getattr(importlib.import_module(module), cls)()
    return parser
