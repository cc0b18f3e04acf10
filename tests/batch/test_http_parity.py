"""A batch row's body is what the live HTTP server answers for the same request (ids and times aside),
on every route of the route table.

The server and the batch job run the same tiny model on one local Ray; greedy and seeded rows make
both answers deterministic, so equality is exact, error bodies (400s) included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from raytp.batch.runner import BatchJob, run_batch
from raytp.openai.routes import ROUTES_BY_PATH
from tests.batch.helpers import ENGINE, MODEL_NAME, by_id, comparable, engine_config, mixed_rows, read_lines, write_rows
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.live_server import live_server

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 40, "temperature": 0}


def test_batch_bodies_equal_the_http_servers(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "model")
    rows = [r for r in mixed_rows(num_plain=2) if r["custom_id"] != "bad-stream"]  # the server would stream it
    rows += [
        {"custom_id": cid, "method": "POST", "url": url, "body": body}
        for cid, url, body in [
            ("tokenize", "/tokenize", {"prompt": "hello there"}),
            ("tokenize-chat", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
            ("tokenize-both", "/tokenize", {"prompt": "x", "messages": []}),
            ("detokenize", "/detokenize", {"tokens": [1, 2, 3]}),
            ("detokenize-bad", "/detokenize", {"tokens": [1 << 30]}),
            # a generation model refuses pooling requests the same way on both roads (tests/serving/
            # test_pooling_routes.py runs them on pooling models)
            ("embed-on-chat", "/v1/embeddings", {"input": ["hi", "there"]}),
            ("score-on-chat", "/v1/score", {"text_1": "a", "text_2": ["b", "c"]}),
            ("rerank-on-chat", "/v1/rerank", {"query": "a", "documents": ["b"]}),
            ("embed-bad-format", "/v1/embeddings", {"input": "hi", "encoding_format": "int8"}),
        ]
    ]
    rows += [  # structured outputs and tool calls go through the same handlers
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {**CHAT, **extra}}
        for cid, extra in [
            (
                "json-schema",
                {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
            ),
            ("json-seeded", {"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 3}),
            ("tool-named", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "pick"}}}),
            ("tool-required", {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
            ("bad-schema", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}}),
            ("bad-tool", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ]
    ]
    assert {r["url"] for r in rows} == set(ROUTES_BY_PATH), "every route of the server has a row here"
    src = write_rows(tmp_path / "in.jsonl", rows)
    with live_server({"model": model_dir, "served_model_name": MODEL_NAME, **ENGINE}, num_cpus=8) as server:
        job = BatchJob(str(src), str(tmp_path / "out.jsonl"), None, engine_config(model_dir), MODEL_NAME,
                       show_progress=False)  # fmt: skip
        assert run_batch(job).status == "completed"
        got = by_id(read_lines(tmp_path / "out.jsonl"))
        for r in rows:
            resp = requests.post(server.url(str(r["url"])), json=r["body"], timeout=120)
            assert got[str(r["custom_id"])] == (resp.status_code, comparable(resp.json())), r["custom_id"]
