"""Flags built from config dataclasses' fields: the engine's from `EngineConfig`, named like vLLM's
(`--max-model-len`, ...), so `vllm` command lines carry over, and `raytp serve`'s own from `ServeArgs`.
A new knob is a new field (with its help text in the field's metadata), never restated here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

from cluster.config import EngineConfig

_SHORT = {"tensor_parallel_size": "-tp"}  # vLLM's short forms


def _json_object(text: str) -> dict[str, Any]:
    """A dict-typed flag's value: a JSON object, else argparse's usage error (exit 2) saying what is wrong."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}: {text!r}")
    return value


def _scalar_type(hint: Any) -> Any:
    """int for `int | None`, str for a Literal of strings, JSON for a dict, the hint itself otherwise."""
    origin = get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return _scalar_type(inner)
    if origin is typing.Literal:
        return str
    if origin is dict or hint is dict:
        return _json_object
    return hint


def add_config_args(
    group: argparse._ArgumentGroup | argparse.ArgumentParser,
    config: type[Any],
    skip: tuple[str, ...] = (),
    unset_is_none: bool = False,
) -> None:
    """One flag per field of the dataclass `config` (but `skip`). With `unset_is_none`, a flag left out
    parses as None, so the dataclass's own default applies where the values are used."""
    hints = get_type_hints(config)
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *([_SHORT[f.name]] if f.name in _SHORT else [])]
        kind = _scalar_type(hints[f.name])
        default = None if unset_is_none else f.default
        help_text = f.metadata.get("help")
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            choices = f.metadata.get("choices")
            group.add_argument(*flags, type=kind, default=default, choices=choices, help=help_text)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per EngineConfig field (but `skip`: each command names the model its own way)."""
    add_config_args(parser.add_argument_group("engine"), EngineConfig, skip)


def engine_fields_of(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_fields_of(args))
