"""Hostile structured-output and tool specs against a live server (issue 36): deep, wide, recursive, cyclic
`$ref`, huge enums and regexes, a grammar that crashes llguidance's native code, shapes of the wrong type.

For each: a 4xx JSON error naming the field (its time printed: 2 s is the target), a greedy stream
running beside it gets every token, the process that hosts the engine is the same one afterwards (no
replica restart), and every device KV block is free again (no leak). One server for the module (embedded SmolLM2).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import requests

from tests.serving.live_server import SMALL_ENGINE, LiveServer, live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a city as JSON."}]
STREAM_TOKENS = 24


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}}
    return s


def nested_text(n: int) -> str:
    """nested(n) as JSON text, written without json.dumps (which recurses: the client would fail first)."""
    return '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n


def chain_grammar(rules: int) -> str:
    """36 KB of Lark, within every bound: llguidance segfaults building its matcher (caught in the worker)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "x"\n'


def json_schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}}


TAG = {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}
# (the request's constraint fields, as a dict or as the JSON text of an object; the field the 400 names)
CASES: dict[str, tuple[dict[str, Any] | str, str]] = {
    "ref-chain-5000": (json_schema(ref_chain(5000)), "response_format"),  # killed the replica before
    "nested-120": (json_schema(nested(120)), "response_format"),
    # JSON text: 1,040 levels, past what Python's json module encodes or decodes (a 500 before issue 36)
    "deep-no-additional": (
        '{"structured_outputs":{"disable_additional_properties":true,"json":' + nested_text(520) + "}}",
        "structured_outputs",
    ),
    "wide-5000-optional": (
        json_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}),
        "response_format",
    ),
    "ref-cycle": (
        {"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
        "guided_json",
    ),
    "enum-100k": ({"structured_outputs": {"json": {"enum": list(range(100_000))}}}, "structured_outputs"),
    "choice-10k": ({"guided_choice": [f"c{i}" for i in range(10_000)]}, "guided_choice"),
    "regex-100k": ({"guided_regex": "(a|b)" * 20_000}, "guided_regex"),
    "grammar-crashes-llguidance": ({"guided_grammar": chain_grammar(3000)}, "guided_grammar"),
    "grammar-ambiguous-unterminated": ({"guided_grammar": "start: x\nx: x x | x x x | x\n"}, "guided_grammar"),
    "tag-begin-not-string": (
        {"structured_outputs": {"structural_tag": {"structures": [{**TAG, "begin": 7}], "triggers": ["<f"]}}},
        "structured_outputs",
    ),
    "tag-300-structures": (
        {"structured_outputs": {"structural_tag": {"structures": [TAG] * 300, "triggers": ["<f"]}}},
        "structured_outputs",
    ),
    "tool-string-parameters": (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
}


@pytest.fixture(scope="module")
def server() -> Any:
    with live_server({**SMALL_ENGINE, "max_num_seqs": 16}) as s:
        # One constrained request first: the compile worker is up before the first hostile spec reaches it.
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "guided_regex": "[a-z]+"}
        assert requests.post(s.url("/v1/chat/completions"), json=body, timeout=120).status_code == 200
        yield s


@pytest.fixture(scope="module")
def engine_pid(server: LiveServer) -> int:
    pid: int = server.stats()["pid"]
    return pid


def hostile_beside_a_stream(server: LiveServer, body: dict[str, Any] | str) -> tuple[requests.Response, float, int]:
    """(the hostile request's response, its seconds, the stream's completion tokens), both in flight at once."""

    async def run() -> tuple[requests.Response, float, int]:
        client = server.async_client()
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            stream=True,
            max_tokens=STREAM_TOKENS,
            temperature=0.0,
            stream_options={"include_usage": True},
        )
        tokens = 0

        async def consume() -> None:
            nonlocal tokens
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens

        def hostile() -> tuple[requests.Response, float]:
            t0 = time.perf_counter()
            head = {"model": MODEL, "messages": ASK, "max_tokens": 8}
            text = json.dumps({**head, **body}) if isinstance(body, dict) else json.dumps(head)[:-1] + "," + body[1:]
            url = server.url("/v1/chat/completions")
            resp = requests.post(url, data=text, headers={"Content-Type": "application/json"}, timeout=60)
            return resp, time.perf_counter() - t0

        consumed = asyncio.create_task(consume())
        resp, seconds = await asyncio.to_thread(hostile)
        await consumed
        return resp, seconds, tokens

    return asyncio.run(run())


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_spec_is_a_4xx_and_nobody_else_notices(server: LiveServer, engine_pid: int, case: str) -> None:
    body, param = CASES[case]
    resp, seconds, stream_tokens = hostile_beside_a_stream(server, body)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert error["param"] == param, error
    # Issue 36 asks for the answer within 2 s; the machine's load decides timings, so the figure is printed
    # (docs/benchmarks.md records a run), never asserted (STYLE: no timed assertions).
    print(f"\n{case}: {resp.status_code} in {seconds:.2f} s")
    assert stream_tokens == STREAM_TOKENS
    stats = server.wait_idle()  # every device KV block free again
    assert stats["pid"] == engine_pid and stats["healthy"]


def test_the_crash_was_contained_in_the_compile_worker(server: LiveServer, engine_pid: int) -> None:
    """The crashing grammar killed a compile worker (replaced), never the engine's process; specs compile
    after it."""
    before = server.stats()
    resp, _, _ = hostile_beside_a_stream(server, CASES["grammar-crashes-llguidance"][0])
    assert resp.status_code == 400 and "crashed" in resp.json()["error"]["message"]
    after = server.stats()
    assert after["grammar_worker_restarts"] == before["grammar_worker_restarts"] + 1
    assert after["grammar_worker_pid"] != before["grammar_worker_pid"] and after["pid"] == engine_pid
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "guided_choice": ["yes", "no"]}
    reply = requests.post(server.url("/v1/chat/completions"), json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] in ("yes", "no")


NODE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1}}}
LEGAL = {
    # recursion through structure (a tree) is not a cycle: a grammar rule, never expanded
    "recursive-tree": json_schema({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}),
    # every parse is ambiguous: llguidance's Earley parser keeps each mask within its per-step item budget
    "ambiguous-grammar": {"guided_grammar": 'start: x\nx: x x | x x x | "a" | x\n'},
    "regex-counted-repetition": {"guided_regex": "(a{1,1000}){1,1000}"},
}


@pytest.mark.parametrize("case", list(LEGAL))
def test_legal_but_awkward_specs_are_served(server: LiveServer, engine_pid: int, case: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, **LEGAL[case]}
    t0 = time.perf_counter()
    assert requests.post(server.url("/v1/chat/completions"), json=body, timeout=120).status_code == 200
    print(f"\n{case}: 200 in {time.perf_counter() - t0:.2f} s")
    assert server.wait_idle()["pid"] == engine_pid
