"""StructuredOutputsParams: the constraint a request puts on its output (vLLM's names and semantics).

Exactly one kind is set: a JSON schema (`json`), any JSON object (`json_object`), a regular expression
(`regex`), one of several strings (`choice`), a grammar (`grammar`: Lark, or GBNF/EBNF as llama.cpp and
xgrammar write it), or a structural tag (`structural_tag`: free text in which tagged regions follow a
schema; what tool calls compile to). The spec is plain data, torch-free and hashable by `key`: the
controller compiles it (cluster/structured_output/), caches the compiled grammar by `key`, and keeps one
matcher per sample. Only the shape is checked here; whether the spec compiles is the compiler's word,
and its failure is a 400 naming `field` (the request field it came from, e.g. "response_format").
Before that, the spec must fit the bounds of `structured_limits` (depth with refs expanded, size, enum
and regex lengths): a hostile spec is refused here, before any grammar library runs.
`start_after` delays the constraint until the output has ended its reasoning (see the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from scheduler import structured_limits as limits
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
                except (ValueError, RecursionError) as e:  # json.loads recurses: a 10k-deep text is an error
                    raise RequestError(f"{name} is not valid JSON: {e}", self.field) from None
                object.__setattr__(self, name, parsed)
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict | bool if name == "json" else dict):
                raise RequestError(f"{name} must be a JSON object, got {type(value).__name__}.", self.field)
        for name in ("regex", "grammar", "whitespace_pattern", "start_after"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RequestError(f"{name} must be a string, got {type(value).__name__}.", self.field)
        self._check_limits()

    def _check_limits(self) -> None:
        f = self.field
        limits.check_text(f, "regex", self.regex, limits.MAX_REGEX_CHARS)
        limits.check_text(f, "whitespace_pattern", self.whitespace_pattern, limits.MAX_REGEX_CHARS)
        limits.check_text(f, "grammar", self.grammar, limits.MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            limits.check_choice(f, tuple(self.choice))
        if isinstance(self.json, dict):
            limits.check_schema(f, self.json)
        if isinstance(self.structural_tag, dict):
            limits.check_document(f, "structural_tag", self.structural_tag)
            for schema in _structural_tag_schemas(f, self.structural_tag):
                limits.check_schema(f, schema)

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


def _structural_tag_schemas(field: str, tag: dict[str, Any]) -> list[Any]:
    """The shape of vLLM's structural tag, checked before anything reads it: {"structures": [{"begin": str,
    "schema": object, "end": str}, ...], "triggers": [str, ...]}, both non-empty. Returns the schemas."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise RequestError("structural_tag.structures must be a non-empty list.", field)
    if len(structures) > limits.MAX_STRUCTURES:
        raise RequestError(
            f"structural_tag has {len(structures)} structures; the limit is {limits.MAX_STRUCTURES}.",
            field,
            code="structured_output_limit",
        )
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise RequestError("structural_tag.triggers must be a non-empty list of non-empty strings.", field)
    for i, s in enumerate(structures):
        if not isinstance(s, dict):
            raise RequestError(f"structural_tag.structures[{i}] must be an object.", field)
        for key in ("begin", "end"):
            if not isinstance(s.get(key), str):
                raise RequestError(f"structural_tag.structures[{i}].{key} must be a string.", field)
        if not isinstance(s.get("schema"), dict | bool):
            raise RequestError(f"structural_tag.structures[{i}].schema must be a JSON schema object.", field)
    return [s["schema"] for s in structures]
