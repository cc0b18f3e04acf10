"""A Dataset row -> its OpenAI request, and an answer -> its columns (no engine, milliseconds)."""

from __future__ import annotations

import json

import numpy as np

from raytp.batch.output import output_line
from raytp.batch.processor import request_of
from raytp.batch.row_replica import OUTPUT_COLUMNS, columns_of


def test_prompt_rows_go_to_completions_and_messages_rows_to_chat() -> None:
    req = json.loads(request_of({"prompt": "hi", "sampling_params": {"max_tokens": 3, "stop": ["x"]}}))
    assert req == {"url": "/v1/completions", "body": {"max_tokens": 3, "stop": ["x"], "prompt": "hi"}}
    req = json.loads(request_of({"messages": [{"role": "user", "content": "yo"}], "other": 1}))
    assert req == {"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "yo"}]}}


def test_rows_read_back_from_arrow_become_plain_json() -> None:
    """Arrow hands back numpy arrays and scalars, and nulls for the keys other rows had."""
    row = {
        "prompt": None,
        "messages": np.array([{"role": "user", "content": "a"}], dtype=object),
        "sampling_params": {"max_tokens": np.int64(4), "stop": np.array(["s"]), "seed": None, "n": None},
    }
    req = json.loads(request_of(row))
    assert req["body"] == {"max_tokens": 4, "stop": ["s"], "messages": [{"role": "user", "content": "a"}]}


def test_a_row_without_exactly_one_request_is_refused() -> None:
    for row in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        assert "exactly one of" in json.loads(request_of(row))["error"]
    assert "sampling_params" in json.loads(request_of({"prompt": "a", "sampling_params": [1]}))["error"]


def test_columns_of_an_answer_and_of_an_error() -> None:
    body = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    cols = columns_of(output_line("c", "chatcmpl-1", 200, body))
    assert set(cols) == set(OUTPUT_COLUMNS)
    assert (cols["generated_text"], cols["num_input_tokens"], cols["num_generated_tokens"]) == ("ok", 5, 2)
    assert (cols["finish_reason"], cols["error"], cols["status_code"]) == ("stop", None, 200)
    assert json.loads(cols["response"]) == body
    err = {"error": {"message": "temperature must be >= 0", "type": "invalid_request_error", "param": "temperature"}}
    cols = columns_of(output_line("c", "cmpl-2", 400, err))
    assert (cols["error"], cols["status_code"], cols["generated_text"]) == ("temperature must be >= 0", 400, None)
