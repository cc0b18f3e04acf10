"""The bounds a structured-output spec must fit before any grammar library sees it (issue 36).

Each bound is a 400 naming the request field the spec came from, with the bound in the message. Every
walk here is iterative (an explicit stack), so a schema nested 100,000 levels deep costs a loop, not a
RecursionError, and nothing here recurses into a user's data.

Why these numbers (docs/openai_contract.md, "Structured-output limits", compares them):
- llguidance parses a schema with serde_json, whose nesting limit is 128 levels ("recursion limit
  exceeded"); a schema that reaches the same depth through `$ref`s escapes that check, and llguidance's
  matcher construction then overflows its native stack (segfault between 1,000 and 2,000 nested `$ref`
  levels, measured). `MAX_SCHEMA_DEPTH` counts the levels with every `$ref` expanded (a ref is a level),
  so a ref chain is held to the depth an inline schema already is. Recursive schemas (a tree node that
  refers to itself under `properties`) stay legal: a back edge is compiled as a grammar rule, not expanded.
- A `$ref` cycle with no structure between (A -> B -> A) describes no value at all: refused by name.
- vLLM (xgrammar) and llguidance document no schema-size bounds beyond llguidance's `LLParserLimits`
  (grammar symbols 500k, lexer fuel 1M, lexer states 250k), which bound work, not the native stack.
  OpenAI's strict mode is far tighter (5,000 properties, 10 levels, 1,000 enum values in all); these are
  wider, so every schema OpenAI takes is taken here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scheduler.errors import RequestError

MAX_SCHEMA_DEPTH = 128  # JSON levels, each $ref expanded and counted as one (serde_json's own limit)
MAX_SPEC_BYTES = 512 * 1024  # the spec's canonical JSON text (a schema, a structural tag)
MAX_ENUM_VALUES = 4096  # values of one `enum`, strings of one `choice`
MAX_PROPERTIES = 5000  # properties of all objects of a schema (OpenAI's strict-mode bound)
# Optional properties of one object: llguidance's grammar for them grows with the square of their count
# (any subset, in order): 1,000 compile in 0.19 s, 2,000 in 0.72 s, 5,000 in 3.7 s (measured, SmolLM2).
MAX_OPTIONAL_PROPERTIES = 1024
MAX_REGEX_CHARS = 8192  # `regex`, a schema's `pattern`, `whitespace_pattern`
MAX_GRAMMAR_CHARS = 64 * 1024  # a Lark / GBNF grammar's text
MAX_STRUCTURES = 256  # structures of one structural tag

_DEFS = ("$defs", "definitions")  # containers reached only through a $ref, never walked as structure


@dataclass(frozen=True)
class _Ref:
    depth: int  # JSON levels from the walked node down to the {"$ref": ...} object
    target: str


def _refuse(field: str, what: str) -> RequestError:
    return RequestError(f"{field}: {what}", field, code="structured_output_limit")


def check_text(field: str, name: str, value: str | None, limit: int) -> None:
    if value is not None and len(value) > limit:
        raise _refuse(field, f"{name} is {len(value)} characters long; the limit is {limit}.")


def check_choice(field: str, choice: tuple[str, ...]) -> None:
    if len(choice) > MAX_ENUM_VALUES:
        raise _refuse(field, f"choice has {len(choice)} strings; the limit is {MAX_ENUM_VALUES}.")
    size = sum(len(c) for c in choice)
    if size > MAX_SPEC_BYTES:
        raise _refuse(field, f"choice holds {size} characters; the limit is {MAX_SPEC_BYTES}.")


def check_document(field: str, name: str, doc: Any) -> None:
    """A JSON document's raw nesting, then its size (json.dumps recurses: depth first)."""
    _raw_depth(field, name, doc)
    size = len(json.dumps(doc, separators=(",", ":")))
    if size > MAX_SPEC_BYTES:
        raise _refuse(field, f"{name} is {size} bytes of JSON; the limit is {MAX_SPEC_BYTES}.")


def check_schema(field: str, schema: Any) -> None:
    """A JSON schema's nesting (refs expanded), $ref cycles, enum sizes and pattern lengths."""
    check_document(field, "the JSON schema", schema)
    if not isinstance(schema, dict):
        return
    stack: list[Any] = [schema]
    properties = 0
    while stack:  # enums, patterns and properties, anywhere (also inside $defs)
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                required = node.get("required")
                named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                optional = len(set(props) - named)
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise _refuse(
                        field,
                        f"an object has {optional} optional properties; the limit is {MAX_OPTIONAL_PROPERTIES} "
                        f"(list the others in `required`).",
                    )
                if properties > MAX_PROPERTIES:
                    raise _refuse(field, f"the JSON schema has more than {MAX_PROPERTIES} properties in all.")
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_ENUM_VALUES:
                raise _refuse(field, f"an enum has {len(enum)} values; the limit is {MAX_ENUM_VALUES}.")
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_text(field, "a schema pattern", pattern, MAX_REGEX_CHARS)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    _expanded_depth(field, schema)


def _raw_depth(field: str, name: str, doc: Any) -> None:
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _refuse(field, f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels.")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))


def _local(node: Any) -> tuple[int, list[_Ref]]:
    """(the subtree's own depth, its $refs with their depth), not entering $defs/definitions."""
    deepest, refs = 0, []
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        cur, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(cur, dict):
            ref = cur.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.append(_Ref(depth, ref))
            stack.extend((v, depth + 1) for k, v in cur.items() if k not in _DEFS and isinstance(v, dict | list))
        elif isinstance(cur, list):
            stack.extend((v, depth + 1) for v in cur if isinstance(v, dict | list))
    return deepest, refs


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """A local JSON pointer ("#", "#/$defs/a", "#/properties/x/items"); None if it points nowhere (the
    compiler names that error itself)."""
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _expanded_depth(field: str, root: dict[str, Any]) -> None:
    """The deepest path with every $ref expanded (each ref one level more), by an iterative DFS over ref
    targets with memoized depths. A back edge (recursion) adds nothing: it becomes a grammar rule. A cycle
    whose every link sits at the top of its target ({"$ref"} -> {"$ref"} -> ...) describes no value."""
    memo: dict[str, int] = {}
    on_path: dict[str, bool] = {}  # target -> was it entered through a top-level $ref (no structure)
    locals_: dict[str, tuple[int, list[_Ref]]] = {}

    def local_of(target: str) -> tuple[int, list[_Ref]]:
        if target not in locals_:
            node = _resolve(root, target)
            locals_[target] = _local(node) if node is not None else (0, [])
        return locals_[target]

    # frames: (target, index of the next ref to visit, best depth so far, entered through a bare ref)
    frames: list[list[Any]] = [["#", 0, local_of("#")[0], False]]
    on_path["#"] = False
    while frames:
        frame = frames[-1]
        target, i, best, _ = frame
        _, refs = local_of(target)
        if i < len(refs):
            frame[1] += 1
            ref = refs[i]
            if ref.target in memo:
                frame[2] = max(best, ref.depth + memo[ref.target])
            elif ref.target in on_path:  # a back edge: recursion
                bare = ref.depth == 1
                if bare and all(f[3] for f in frames[_index(frames, ref.target) + 1 :]):
                    raise _refuse(field, f"the $ref {ref.target!r} refers to itself through $refs alone (a cycle).")
            else:
                on_path[ref.target] = ref.depth == 1
                frames.append([ref.target, 0, local_of(ref.target)[0], ref.depth == 1])
            continue
        frames.pop()
        del on_path[target]
        memo[target] = best
        if best > MAX_SCHEMA_DEPTH:
            raise _refuse(
                field,
                f"the JSON schema nests {best} levels deep with its $refs expanded; the limit is {MAX_SCHEMA_DEPTH}.",
            )
        if frames:
            parent = frames[-1]
            parent_refs = local_of(parent[0])[1]
            parent[2] = max(parent[2], parent_refs[parent[1] - 1].depth + best)


def _index(frames: list[list[Any]], target: str) -> int:
    return next(i for i, f in enumerate(frames) if f[0] == target)
