"""A structured-output spec as llguidance grammar text: the one translation the compile worker's child runs
(cluster/grammar_worker.py) and the in-process tools (benchmarks) call.

Below both the worker and the controller's manager (cluster/structured_output.py): it imports only the
request vocabulary, and llguidance where a grammar is built (never at module load; see structured_output.py).
"""

from __future__ import annotations

from typing import Any

from request.errors import RequestError
from request.structured_outputs import StructuredOutputsParams

# Optional whitespace between JSON tokens, unless the request gives `whitespace_pattern`: a line break and
# indentation fit, but not unbounded runs. Decision: llguidance's default (`[ \t\n\r]+`) let 1 of 200
# seeded samples at temperature 1.0 on SmolLM2 spend all its tokens on whitespace inside an object
# (tests/cluster/test_structured_output.py); a bound keeps every sample finishing, as Outlines bounds it.
_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


def to_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (JSON text). Raises RequestError for a spec it cannot express."""
    import llguidance

    try:
        if spec.json is not None or spec.json_object:
            schema: Any = spec.json if spec.json is not None else {"type": "object"}
            if spec.disable_additional_properties and isinstance(schema, dict):
                schema = _no_additional_properties(schema)
            # Without whitespace: one compact form, as json.dumps(..., separators=(",", ":")) writes it.
            options: dict[str, Any] = {
                "whitespace_flexible": not spec.disable_any_whitespace,
                "item_separator": ",",
                "key_separator": ":",
            }
            if not spec.disable_any_whitespace:
                options["whitespace_pattern"] = spec.whitespace_pattern or _JSON_WHITESPACE
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))  # type: ignore[arg-type]
        if spec.regex is not None:
            return str(llguidance.LLMatcher.grammar_from_regex(spec.regex))
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))  # type: ignore[arg-type]
        if spec.grammar is not None:
            return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
        assert isinstance(spec.structural_tag, dict)  # StructuredOutputsParams parsed any JSON text
        return _structural_tag_grammar(spec.structural_tag)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise RequestError(f"{spec.field}: the {spec.kind} constraint cannot be compiled: {e}", spec.field) from None


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not say otherwise.
    Iterative (an explicit stack): the spec's depth is bounded (request/structured_limits.py), but no
    walk over a user's schema recurses in Python."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]  # (source node, parent copy, key in the parent)
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, dict):
            out: Any = dict.fromkeys(node)  # the keys in the user's order (properties are generated in it)
            stack.extend((v, out, k) for k, v in node.items())
            if node.get("type") == "object" or "properties" in node:
                out.setdefault("additionalProperties", False)
        elif isinstance(node, list):
            out = [None] * len(node)
            stack.extend((v, out, i) for i, v in enumerate(node))
        else:
            out = node
        parent[key] = out
    return root[0]


def _structural_tag_grammar(tag: dict[str, Any]) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}): free text in
    which every region that starts with a trigger must be one of the structures."""
    import llguidance

    # The shape (non-empty lists, string begin/end/triggers, object schemas) was checked when the spec was
    # made (request/structured_outputs.py), so what is read here exists and has its type.
    structures, triggers = tag["structures"], tag["triggers"]
    tags = []
    for s in structures:
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure begin {s['begin']!r} starts with none of the triggers {triggers}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)
