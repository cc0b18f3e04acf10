"""Engine flags built from `EngineConfig`'s fields, named like vLLM's (`--max-model-len`, ...), so
`vllm` command lines carry over and a new engine knob is a new flag without restating it here."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

from cluster.config import EngineConfig

_SHORT = {"tensor_parallel_size": "-tp"}  # vLLM's short forms


def _scalar_type(hint: Any) -> Any:
    """int for `int | None`, str for a Literal of strings, the hint itself otherwise."""
    origin = get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return _scalar_type(inner)
    if origin is typing.Literal:
        return str
    return hint


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per EngineConfig field (but `skip`: each command names the model its own way)."""
    g = parser.add_argument_group("engine")
    hints = get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *([_SHORT[f.name]] if f.name in _SHORT else [])]
        kind = _scalar_type(hints[f.name])
        help_text = f.metadata.get("help")
        if kind is bool:
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            choices = f.metadata.get("choices")
            g.add_argument(*flags, type=kind, default=f.default, choices=choices, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**fields)
