"""StructuredOutputsParams: the constraint a request puts on its output (vLLM's names and semantics).

Exactly one kind is set: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`), one of several strings (`choice`), a grammar (`grammar`: Lark, or GBNF/EBNF as llama.cpp and
xgrammar write it), or a structural tag (`structural_tag`: free text in which tagged regions follow a
schema; what tool calls compile to). The spec is plain data, torch-free and hashable by `key`: the
controller compiles it (cluster/structured_output/), caches the compiled grammar by `key`, and keeps one
matcher per sample. Only the shape is checked here; whether the spec compiles is the compiler's word,
and its failure is a 400 naming `field` (the request field it came from, e.g. "response_format").
`start_after` delays the constraint until the output has ended its reasoning (see the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from scheduler.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (`root ::= ...`)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict[str, Any] | None = None  # {"structures": [...], "triggers": [...]} (vLLM's shape)
    disable_any_whitespace: bool = False  # JSON without optional whitespace between tokens
    disable_additional_properties: bool = False  # JSON schema: objects get no properties beyond those listed
    whitespace_pattern: str | None = None  # JSON: the regex optional whitespace must match
    # raytp: the constraint applies only once the output contains this text (the end of a reasoning section,
    # e.g. "</think>"): what vLLM does for `--reasoning-parser` models. The server's reasoning parser sets it.
    start_after: str | None = None
    # Which request field the constraint came from: errors name it (400 `param`). Not part of the spec.
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            what = ", ".join(set_kinds) if set_kinds else "none"
            raise RequestError(f"structured outputs need exactly one of {', '.join(KINDS)}; got {what}.", self.field)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise RequestError("choice must be a non-empty list of strings.", self.field)
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise RequestError(f"{name} is not valid JSON: {e}", self.field) from None
                object.__setattr__(self, name, parsed)
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict | bool):
                raise RequestError(f"{name} must be a JSON object, got {type(value).__name__}.", self.field)
        for name in ("regex", "grammar", "whitespace_pattern", "start_after"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RequestError(f"{name} must be a string, got {type(value).__name__}.", self.field)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """The compiled grammar's cache key: the kind, its spec and every option, canonically serialized."""
        spec = {k: getattr(self, k) for k in KINDS if getattr(self, k) not in (None, False)}
        spec["options"] = [self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern]
        # start_after is not part of the key: it does not change the grammar, only when a matcher starts.
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), default=list)
