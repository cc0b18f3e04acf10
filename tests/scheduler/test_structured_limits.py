"""The bounds a structured-output spec must fit before any grammar library runs (scheduler/structured_limits):
each a RequestError naming the request field with the bound in its message, found by iterative walks (a
100,000-deep document is a refusal, not a RecursionError)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler import structured_limits as limits
from scheduler.errors import RequestError
from scheduler.structured_outputs import StructuredOutputsParams as Spec


def ref_chain(n: int, nested: bool = False) -> dict[str, Any]:
    """$defs d0 -> d1 -> ... -> dn: bare refs, or each one an object whose property refers to the next."""

    def link(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"type": "object", "properties": {"a": ref}} if nested else ref

    defs = {f"d{i}": link(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


def refused(**kw: Any) -> RequestError:
    with pytest.raises(RequestError) as e:
        Spec(field="response_format", **kw)
    assert e.value.param == "response_format"
    return e.value


@pytest.mark.parametrize(
    "schema, words",
    [
        (ref_chain(5000), "the limit is 128"),  # what segfaulted llguidance (issue 36)
        (ref_chain(200, nested=True), "128"),
        (nested(100_000), "deeper than 128"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}, "cycle"),
        ({"$ref": "#"}, "cycle"),
        ({"enum": list(range(limits.MAX_ENUM_VALUES + 1))}, "4096"),
        ({"type": "object", "properties": {f"p{i}": {} for i in range(2000)}}, "optional properties"),
        ({"type": "string", "pattern": "a" * (limits.MAX_REGEX_CHARS + 1)}, "8192"),
        ({"type": "object", "description": "x" * limits.MAX_SPEC_BYTES}, "bytes"),
    ],
    ids=[
        "ref-chain-5000",
        "nested-refs",
        "deep-100k",
        "ref-cycle",
        "root-cycle",
        "enum",
        "optional",
        "pattern",
        "size",
    ],
)
def test_hostile_schemas_are_refused_with_the_bound(schema: dict[str, Any], words: str) -> None:
    assert words in refused(json=schema).message


def test_other_kinds_have_their_bounds() -> None:
    assert "8192" in refused(regex="a" * 9000).message
    assert "65536" in refused(grammar="x" * 70_000).message
    assert "4096" in refused(choice=[str(i) for i in range(5000)]).message
    assert "not valid JSON" in refused(json="[" * 100_000).message  # json.loads recursion, not a 500


def test_legal_schemas_pass() -> None:
    tree = {
        "$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}
    }
    Spec(json={**tree, "$ref": "#/$defs/n"})  # recursion through structure is a grammar rule, not a cycle
    Spec(json=ref_chain(100))
    Spec(json=ref_chain(30, nested=True))
    Spec(json=json.loads('{"type":"object","properties":{"a":' * 60 + "{}" + "}}" * 60))
    props = {f"p{i}": {"type": "string"} for i in range(3000)}
    Spec(json={"type": "object", "properties": props, "required": list(props)})  # required: linear grammar


def test_structural_tag_shape_is_checked_before_use() -> None:
    ok = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]}
    Spec(structural_tag=ok)
    bad_begin = {**ok, "structures": [{"begin": 1, "schema": {}, "end": "x"}]}
    assert "begin must be a string" in refused(structural_tag=bad_begin).message
    assert "triggers" in refused(structural_tag={**ok, "triggers": [3]}).message
    assert "schema" in refused(structural_tag={**ok, "structures": [{"begin": "<f>", "schema": 3, "end": ""}]}).message
    deep_schema = {**ok, "structures": [{"begin": "<f>", "schema": ref_chain(3000), "end": "</f>"}]}
    assert "128" in refused(structural_tag=deep_schema).message
