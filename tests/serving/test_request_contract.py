"""The request contract (issue 31, item 5): every declared field of the chat and completions request
models is honoured (it changes what reaches the engine or what the client gets back), accepted as
metadata (`contract.METADATA`), or refused with a 400 naming it (`contract.refusals`).

The walk goes through the real handlers with a fake engine client that records each request's prompt
ids and SamplingParams, so a field that parses but is dropped on the way shows up as "no difference".
A field added to a request model without a probe here fails `test_every_field_has_a_probe`; one added
with a probe but without a mapping fails `test_every_field_is_honoured_or_refused`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from cluster.outputs import Logprob, PromptInfo, RequestDelta, SampleDelta
from raytp.openai.chat import ChatHandler
from raytp.openai.completions import CompletionHandler
from raytp.openai.context import ServingContext, max_token_chars
from raytp.openai.contract import METADATA, refusals
from raytp.openai.engine_client import EngineRequest
from raytp.openai.errors import to_openai_error, validation_error
from raytp.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    ContentPart,
    StreamOptions,
)
from raytp.openai.structured import JsonSchemaFormat, ResponseFormat, StructuredOutputsIn
from request.sampling_params import SamplingParams
from request.structured_outputs import StructuredOutputsParams
from tests.helpers.tiny_models import save_byte_tokenizer

MAX_MODEL_LEN = 64
NAME = "tiny"
# The tiny byte tokenizer's template, plus message names (so `name` can be seen reaching the template).
# Tools, earlier tool calls, tool results and one template variable (`flag`, for chat_template_kwargs) show too.
TEMPLATE = (
    "{% if tools %}tools: {{ tools | length }}\n{% endif %}{% if flag %}flag\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}{% if m['name'] %}({{ m['name'] }}){% endif %}: {{ m['content'] }}"
    "{% if m['tool_calls'] %} calls: {{ m['tool_calls'] | length }}{% endif %}"
    "{% if m['tool_call_id'] %} for: {{ m['tool_call_id'] }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


class FakeEngine:
    """An EngineClient that records what reaches the engine and answers every sample with "ab"."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        request_id, prompt_token_ids, params = request.request_id, request.prompt_token_ids, request.params
        assert isinstance(params, SamplingParams)
        self.calls.append((list(prompt_token_ids), params))
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [{t: Logprob(-1.0, 1, "p")} for t in prompt_token_ids[1:]]
        prompt = PromptInfo(prompt=None, token_ids=list(prompt_token_ids), logprobs=prompt_lps, num_cached_tokens=0)
        lps = [{t: Logprob(-0.5, 1, "t")} for t in (100, 101)] if params.logprobs is not None else None
        samples = [SampleDelta(i, "ab", [100, 101], lps, None) for i in range(params.n)]
        yield RequestDelta(request_id, samples=samples, prompt=prompt)
        done = [SampleDelta(i, "", [], None, None, finish_reason="length") for i in range(params.n)]
        yield RequestDelta(request_id, samples=done, finished=True)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> ServingContext:
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    # A BOS around text prompts, so add_special_tokens has something to add.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    return ServingContext(FakeEngine(), tok, NAME, MAX_MODEL_LEN, 320, max_token_chars(tok))


Outcome = tuple[Any, ...]  # ("ok", engine calls, response) or ("error", status, param)


def _normal(payload: Any) -> Any:
    """A response with its timestamps dropped (two runs differ only by them)."""
    if isinstance(payload, dict):
        return {k: _normal(v) for k, v in payload.items() if k != "created"}
    if isinstance(payload, list):
        return [_normal(v) for v in payload]
    return payload


async def _run(ctx: ServingContext, path: str, body: dict[str, Any]) -> Outcome:
    model = CompletionRequest if path == "completions" else ChatCompletionRequest
    handler: Any = CompletionHandler(ctx) if path == "completions" else ChatHandler(ctx)
    engine = ctx.client
    assert isinstance(engine, FakeEngine)
    engine.calls.clear()
    try:
        req = model.model_validate(body)
        resp = await handler.create(req, "req-1")
        if isinstance(resp, BaseModel):
            out: Any = resp.model_dump()
        else:
            events = [e async for e in resp]
            out = [json.loads(e[len("data: ") :]) for e in events if not e.startswith("data: [DONE]")]
    except ValidationError as e:
        err = validation_error(e.errors())
        return ("error", err.status, err.param)
    except Exception as e:
        err = to_openai_error(e)
        return ("error", err.status, err.param)
    return ("ok", list(engine.calls), _normal(out))


def run(ctx: ServingContext, path: str, body: dict[str, Any]) -> Outcome:
    return asyncio.run(_run(ctx, path, body))


BASE = {
    "completions": {"prompt": "hello there"},
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TAG = {"begin": "<a>", "schema": SCHEMA, "end": "</a>"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def top(value: Any) -> tuple[dict[str, Any], Any]:
    """A probe of a top-level field: the endpoint's base body against the same with the field set."""
    return ({}, value)


# (endpoint or nested model, field) -> (what both bodies share, the field's non-default value); "*": both
# endpoints. A top-level probe's shared part joins the endpoint's base body; a nested one's is the nested object.
PROBES: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {
    ("*", "model"): top(NAME),
    ("*", "n"): top(2),
    ("*", "best_of"): top(2),
    ("*", "temperature"): top(0.5),
    ("*", "top_p"): top(0.5),
    ("*", "seed"): top(7),
    ("*", "presence_penalty"): top(0.5),
    ("*", "frequency_penalty"): top(0.5),
    ("*", "logit_bias"): top({"5": 1.0}),
    ("*", "stop"): top("x"),
    ("*", "stream"): top(True),
    ("*", "stream_options"): ({"stream": True}, {"include_usage": True}),
    ("*", "response_format"): top({"type": "json_object"}),
    ("*", "structured_outputs"): top({"regex": "a+"}),
    ("*", "guided_json"): top(SCHEMA),
    ("*", "guided_regex"): top("a+"),
    ("*", "guided_choice"): top(["a", "b"]),
    ("*", "guided_grammar"): top('root ::= "a"'),
    ("*", "guided_decoding_backend"): top("guidance"),
    ("*", "guided_whitespace_pattern"): ({"guided_json": SCHEMA}, " "),
    ("*", "user"): top("u"),
    ("*", "metadata"): top({"k": "v"}),
    ("*", "store"): top(True),
    ("*", "service_tier"): top("flex"),
    ("*", "safety_identifier"): top("s"),
    ("*", "prompt_cache_key"): top("k"),
    ("*", "top_k"): top(5),
    ("*", "min_p"): top(0.1),
    ("*", "repetition_penalty"): top(1.1),
    ("*", "stop_token_ids"): top([7]),
    ("*", "ignore_eos"): top(True),
    ("*", "min_tokens"): top(1),
    ("*", "include_stop_str_in_output"): top(True),
    ("*", "skip_special_tokens"): top(False),
    ("*", "spaces_between_special_tokens"): top(False),
    ("*", "truncate_prompt_tokens"): top(2),
    ("*", "use_beam_search"): top(True),
    ("*", "length_penalty"): top(0.5),
    ("*", "prompt_logprobs"): top(1),
    ("*", "allowed_token_ids"): top([5]),
    ("*", "bad_words"): top(["x"]),
    ("*", "priority"): top(1),
    ("*", "request_id"): top("r"),
    ("*", "logits_processors"): top(["x"]),
    ("*", "return_tokens_as_token_ids"): top(True),
    ("*", "return_token_ids"): top(True),
    ("*", "cache_salt"): top("s"),
    ("*", "kv_transfer_params"): top({"a": 1}),
    ("*", "vllm_xargs"): top({"a": 1}),
    ("*", "max_tokens"): top(5),
    ("*", "max_completion_tokens"): top(5),
    ("*", "echo"): top(True),
    ("*", "add_special_tokens"): top(True),  # chat: refused (the template places them)
    ("completions", "add_special_tokens"): top(False),  # completions: no BOS
    ("completions", "prompt"): top("other"),
    ("completions", "logprobs"): top(1),
    ("completions", "suffix"): top("s"),
    ("completions", "prompt_embeds"): top("e"),
    ("chat", "messages"): top([{"role": "user", "content": "ho"}]),
    ("chat", "logprobs"): top(True),
    ("chat", "top_logprobs"): ({"logprobs": True}, 2),
    ("chat", "add_generation_prompt"): top(False),
    ("chat", "modalities"): top(["audio"]),
    ("chat", "audio"): top({"voice": "x"}),
    ("chat", "prediction"): top({"type": "content", "content": "x"}),
    ("chat", "reasoning_effort"): top("high"),
    ("chat", "verbosity"): top("low"),
    ("chat", "web_search_options"): top({}),
    ("chat", "continue_final_message"): top(True),
    ("chat", "documents"): top([{"text": "d"}]),
    ("chat", "chat_template"): top("{{ 1 }}"),
    ("chat", "mm_processor_kwargs"): top({"a": 1}),
    ("chat", "tools"): ({"tool_choice": "none"}, [TOOL]),
    ("chat", "tool_choice"): (
        {"tools": [TOOL], "tool_choice": "none"},
        {"type": "function", "function": {"name": "f"}},
    ),
    ("chat", "parallel_tool_calls"): ({"tools": [TOOL], "tool_choice": "required"}, False),
    ("chat", "functions"): top([{"name": "f", "parameters": SCHEMA}]),
    ("chat", "function_call"): top("auto"),
    ("chat", "chat_template_kwargs"): top({"flag": True}),
    ("ChatMessageIn", "tool_calls"): ({"role": "assistant", "content": "hi"}, [CALL]),
    ("ChatMessageIn", "tool_call_id"): ({"role": "tool", "content": "hi"}, "c1"),
    # nested models: (the parent body both sides share, the field's value)
    ("StreamOptions", "include_usage"): ({}, True),
    ("StreamOptions", "include_obfuscation"): ({}, False),
    ("StreamOptions", "continuous_usage_stats"): ({}, True),
    ("ResponseFormat", "type"): ({"type": "text"}, "json_object"),
    ("ResponseFormat", "json_schema"): ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, {"schema": {}}),
    ("ResponseFormat", "structures"): (
        {"type": "structural_tag", "structures": [{**TAG, "begin": "<ab>"}], "triggers": ["<a"]},
        [TAG],
    ),
    ("ResponseFormat", "triggers"): ({"type": "structural_tag", "structures": [TAG], "triggers": ["<a"]}, ["<"]),
    ("JsonSchemaFormat", "name"): ({"schema": SCHEMA}, "n"),
    ("JsonSchemaFormat", "description"): ({"schema": SCHEMA}, "d"),
    ("JsonSchemaFormat", "schema"): ({"schema": SCHEMA}, {"type": "array"}),
    ("JsonSchemaFormat", "strict"): ({"schema": SCHEMA}, True),
    ("StructuredOutputsIn", "json"): ({"regex": "a"}, SCHEMA),  # the kind probes replace the regex
    ("StructuredOutputsIn", "regex"): ({"regex": "a"}, "b"),
    ("StructuredOutputsIn", "choice"): ({"regex": "a"}, ["a"]),
    ("StructuredOutputsIn", "grammar"): ({"regex": "a"}, 'root ::= "a"'),
    ("StructuredOutputsIn", "json_object"): ({"regex": "a"}, True),
    ("StructuredOutputsIn", "structural_tag"): ({"regex": "a"}, {"structures": [TAG], "triggers": ["<a"]}),
    ("StructuredOutputsIn", "disable_any_whitespace"): ({"json": SCHEMA}, True),
    ("StructuredOutputsIn", "disable_additional_properties"): ({"json": SCHEMA}, True),
    ("StructuredOutputsIn", "whitespace_pattern"): ({"json": SCHEMA}, " "),
    ("StructuredOutputsIn", "disable_fallback"): ({"json": SCHEMA}, True),
    ("ChatMessageIn", "role"): ({"role": "user", "content": "hi"}, "system"),
    ("ChatMessageIn", "content"): ({"role": "user", "content": "hi"}, [{"type": "text", "text": "ho"}]),
    ("ChatMessageIn", "name"): ({"role": "user", "content": "hi"}, "ann"),
    ("ContentPart", "type"): ({"type": "text", "text": "hi"}, "image_url"),
    ("ContentPart", "text"): ({"type": "text", "text": "hi"}, "ho"),
}
# A StructuredOutputsIn probe of one kind replaces the baseline's kind (exactly one may be set).
KINDS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}

# Each nested model: the endpoint it is probed on, its qualified name, and the request fields that hold it.
NESTED: dict[type[BaseModel], tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    StreamOptions: ("completions", "stream_options", lambda o: {"stream": True, "stream_options": o}),
    ResponseFormat: ("completions", "response_format", lambda o: {"response_format": o}),
    JsonSchemaFormat: (
        "completions",
        "response_format.json_schema",
        lambda o: {"response_format": {"type": "json_schema", "json_schema": o}},
    ),
    StructuredOutputsIn: ("completions", "structured_outputs", lambda o: {"structured_outputs": o}),
    ChatMessageIn: ("chat", "messages", lambda o: {"messages": [o]}),
    ContentPart: ("chat", "messages.content", lambda o: {"messages": [{"role": "user", "content": [o]}]}),
}
# A nested field's refusal names the top-level field (the error's `param`), as OpenAI's errors do.
NESTED_REFUSED = {"stream_options.continuous_usage_stats": "stream_options", "messages.content.type": "messages"}


def cases() -> list[tuple[str, str, str, dict[str, Any], dict[str, Any]]]:
    """(endpoint, qualified field, baseline body, probe body) for every declared field."""
    out = []
    for path, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        for field in model.model_fields:
            shared, value = PROBES.get((path, field)) or PROBES.get(("*", field)) or ({}, None)
            baseline = {**BASE[path], **shared}
            out.append((path, field, baseline, {**baseline, field: value}))
    for model, (path, where, wrap) in NESTED.items():
        for field, info in model.model_fields.items():
            wire = info.alias or field
            inner, value = PROBES.get((model.__name__, wire), ({}, None))
            kept = {k: v for k, v in inner.items() if not (wire in KINDS and k in KINDS)}
            probe = {**BASE[path], **wrap({**kept, wire: value})}
            out.append((path, f"{where}.{wire}", {**BASE[path], **wrap(inner)}, probe))
    return out


def test_every_field_has_a_probe() -> None:
    models: list[tuple[str, type[BaseModel]]] = [("completions", CompletionRequest), ("chat", ChatCompletionRequest)]
    models += [(m.__name__, m) for m in NESTED]
    missing = [
        f"{scope}.{wire}"
        for scope, model in models
        for wire in (info.alias or field for field, info in model.model_fields.items())
        if (scope, wire) not in PROBES and ("*", wire) not in PROBES
    ]
    assert not missing, f"request fields without a probe (add one, and map or refuse the field): {missing}"


@pytest.mark.parametrize(("path", "field", "baseline", "probe"), cases(), ids=[f"{c[0]}:{c[1]}" for c in cases()])
def test_every_field_is_honoured_or_refused(
    ctx: ServingContext, path: str, field: str, baseline: dict[str, Any], probe: dict[str, Any]
) -> None:
    before = run(ctx, path, baseline)
    assert before[0] == "ok", f"the baseline itself failed: {before}"
    after = run(ctx, path, probe)
    model = CompletionRequest if path == "completions" else ChatCompletionRequest
    refused_as = NESTED_REFUSED.get(field) or (field if field in refusals(model(**BASE[path])) else None)
    if refused_as is not None:
        assert after == ("error", 400, refused_as), after
    elif field in METADATA:
        assert after[0] == "ok", after
    else:
        assert after[0] == "ok", f"{field}: refused without a refusal in contract.py: {after}"
        assert after != before, f"{field} parses but changes nothing that reaches the engine or the client"


# Fields whose null is not their default, as in vLLM: null max_tokens on completions means "as many as fit".
NULL_IS_NOT_DEFAULT = {("completions", "max_tokens")}


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (path, field)
        for path, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest))
        for field, info in model.model_fields.items()
        if not info.is_required() and (path, field) not in NULL_IS_NOT_DEFAULT
    ],
)
def test_null_means_the_default(ctx: ServingContext, path: str, field: str) -> None:
    assert run(ctx, path, {**BASE[path], field: None}) == run(ctx, path, BASE[path])


def test_null_in_nested_objects_means_the_default(ctx: ServingContext) -> None:
    body = {**BASE["chat"], "stream": True, "stream_options": {"include_usage": None}}
    assert run(ctx, "chat", body) == run(ctx, "chat", {**BASE["chat"], "stream": True, "stream_options": {}})
    body = {**BASE["completions"], "structured_outputs": {"regex": "a", "disable_any_whitespace": None}}
    assert run(ctx, "completions", body) == run(
        ctx, "completions", {**BASE["completions"], "structured_outputs": {"regex": "a"}}
    )


def test_unknown_fields_are_accepted_and_logged_once_per_name(
    ctx: ServingContext, caplog: pytest.LogCaptureFixture
) -> None:
    from raytp.openai import base

    body = {**BASE["completions"], "raytp_test_unknown_field": 1}
    with caplog.at_level(logging.WARNING, logger=base.__name__):
        assert run(ctx, "completions", body) == run(ctx, "completions", BASE["completions"])
        assert run(ctx, "completions", body)[0] == "ok"
    hits = [r for r in caplog.records if "raytp_test_unknown_field" in r.getMessage()]
    assert len(hits) == 1, [r.getMessage() for r in caplog.records]


def params_of(ctx: ServingContext, path: str, **fields: Any) -> SamplingParams:
    out = run(ctx, path, {**BASE[path], **fields})
    assert out[0] == "ok", out
    ((_, params),) = out[1]
    return params


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_constraints_reach_sampling_params_naming_their_field(ctx: ServingContext, path: str) -> None:
    def so(**fields: Any) -> StructuredOutputsParams | None:
        return params_of(ctx, path, **fields).structured_outputs

    assert so(response_format={"type": "text"}) is None
    got = so(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert got == StructuredOutputsParams(json=SCHEMA) and got.field == "response_format"
    assert so(response_format={"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    got = so(structured_outputs={"choice": ["yes", "no"], "disable_fallback": True})
    assert got == StructuredOutputsParams(choice=("yes", "no")) and got.field == "structured_outputs"
    got = so(structured_outputs={"json": json.dumps(SCHEMA), "disable_any_whitespace": True})
    assert got == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    got = so(guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?", guided_decoding_backend="guidance")
    assert got == StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?") and got.field == "guided_json"
    assert so(guided_regex="a+") == StructuredOutputsParams(regex="a+")
    assert so(guided_grammar='root ::= "a"') == StructuredOutputsParams(grammar='root ::= "a"')
    tag = so(response_format={"type": "structural_tag", "structures": [TAG], "triggers": ["<a"]})
    assert tag == StructuredOutputsParams(structural_tag={"structures": [TAG], "triggers": ["<a"]})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}}, "response_format"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
        ({"store": True}, "store"),
        ({"service_tier": "priority"}, "service_tier"),
    ],
)
def test_bad_specs_are_400s_naming_the_field(ctx: ServingContext, fields: dict[str, Any], param: str) -> None:
    for path in ("completions", "chat"):
        assert run(ctx, path, {**BASE[path], **fields}) == ("error", 400, param)


def test_neutral_values_of_refused_fields_are_served(ctx: ServingContext) -> None:
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "store": False, "suffix": ""}
    assert run(ctx, "completions", {**BASE["completions"], **neutral}) == run(ctx, "completions", BASE["completions"])
    neutral = {"modalities": ["text"], "service_tier": "auto", "echo": False, "add_special_tokens": False}
    assert run(ctx, "chat", {**BASE["chat"], **neutral}) == run(ctx, "chat", BASE["chat"])


def test_max_completion_tokens_and_truncation_on_completions(ctx: ServingContext) -> None:
    assert params_of(ctx, "completions").max_tokens == 16  # OpenAI's default for legacy completions
    assert params_of(ctx, "completions", max_completion_tokens=5).max_tokens == 5
    assert params_of(ctx, "completions", max_tokens=9, max_completion_tokens=5).max_tokens == 5
    out = run(ctx, "completions", {**BASE["completions"], "truncate_prompt_tokens": 3, "echo": True})
    assert out[0] == "ok"
    ((ids, _),) = out[1]
    assert len(ids) == 3 and out[2]["choices"][0]["text"] == "ere" + "ab"  # echo shows what was kept
