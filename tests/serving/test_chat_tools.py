"""Tool calling and reasoning in the chat handler, driven by a fake engine that answers with chosen text.

The engine's constraint is not exercised here (the fake ignores it): these tests check what the
handler asks of the engine (the constraint, the prompt through a template that reads tools) and what
it makes of the text it gets back, streamed and not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cluster.outputs import PromptInfo, RequestDelta, SampleDelta
from raytp.openai.chat import ChatHandler
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.context import ServingContext
from raytp.openai.engine_client import EngineRequest
from raytp.openai.errors import OpenAIError
from raytp.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from raytp.openai.tools import NO_ARGUMENTS
from request.errors import RequestError
from request.sampling_params import SamplingParams
from tests.helpers.tiny_models import save_byte_tokenizer

TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}"
    "{% if t.function.parameters is defined %}{{ t.function.parameters | tojson }}{% endif %};"
    "{% endfor %}</tools>{% endif %}"
    "{%- if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>"
    "{%- for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "</call>{% endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


class FakeEngine:
    """Answers every request with `texts` (one per sample), a few characters per delta."""

    def __init__(self, texts: list[str], piece: int = 3) -> None:
        self.texts = texts
        self.piece = piece
        self.params: SamplingParams | None = None
        self.prompt_ids: list[int] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        request_id, prompt_token_ids, params = request.request_id, request.prompt_token_ids, request.params
        assert isinstance(params, SamplingParams)
        self.params, self.prompt_ids = params, prompt_token_ids
        yield RequestDelta(request_id, prompt=PromptInfo(None, prompt_token_ids, None, 0))
        longest = max(len(t) for t in self.texts)
        for at in range(0, longest, self.piece):
            samples = [
                SampleDelta(i, t[at : at + self.piece], [7], None, None)
                for i, t in enumerate(self.texts)
                if at < len(t)
            ]
            yield RequestDelta(request_id, samples)
        done = [SampleDelta(i, "", [2], None, None, finish_reason="stop") for i in range(len(self.texts))]
        yield RequestDelta(request_id, done, finished=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    return tok


def handler(tokenizer: Any, engine: FakeEngine, **settings: Any) -> ChatHandler:
    ctx = ServingContext(engine, tokenizer, "m", max_model_len=4096, vocab_size=259, max_token_chars=4)
    return ChatHandler(ctx, ChatSettings(**settings))


def respond(h: ChatHandler, **body: Any) -> ChatCompletionResponse:
    body.setdefault("messages", USER)
    out = asyncio.run(h.create(ChatCompletionRequest(**body), "chatcmpl-1"))
    assert isinstance(out, ChatCompletionResponse)
    return out


def stream_chunks(h: ChatHandler, **body: Any) -> list[dict[str, Any]]:
    body.setdefault("messages", USER)

    async def run() -> list[str]:
        out = await h.create(ChatCompletionRequest(stream=True, **body), "chatcmpl-1")
        assert not isinstance(out, ChatCompletionResponse)
        return [event async for event in out]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def reassemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client's accumulator builds from choice 0's deltas; checks the tool-call delta shapes."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": [], "finish_reason": None}
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        msg["content"] += delta.get("content", "")
        msg["reasoning_content"] += delta.get("reasoning_content", "")
        for entry in delta.get("tool_calls", ()):
            if entry["index"] == len(msg["tool_calls"]):  # the first delta of a call: id and name, no arguments
                assert entry["id"] and entry["type"] == "function" and entry["function"]["arguments"] == ""
                msg["tool_calls"].append({"id": entry["id"], "function": dict(entry["function"])})
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                msg["tool_calls"][entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
        msg["finish_reason"] = choice["finish_reason"] or msg["finish_reason"]
    return msg


def call_list(calls: list[Any]) -> list[tuple[str, Any]]:
    def fn(c: Any) -> Any:
        return c["function"] if isinstance(c, dict) else c.function.model_dump()

    return [(fn(c)["name"], json.loads(fn(c)["arguments"])) for c in calls]


# ----------------------------------------------------------------------------- required and named


REQUIRED_OUT = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


def test_required_constrains_to_an_array_of_calls_and_answers_tool_calls(tokenizer: Any) -> None:
    engine = FakeEngine([REQUIRED_OUT])
    h = handler(tokenizer, engine)
    out = respond(h, tools=TOOLS, tool_choice="required")
    so = engine.params.structured_outputs if engine.params else None
    assert so is not None and so.field == "tool_choice"
    assert so.json["minItems"] == 1 and "maxItems" not in so.json
    items = so.json["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["get_weather", "get_time"]
    assert (
        items[0]["properties"]["parameters"] == WEATHER_SCHEMA and items[1]["properties"]["parameters"] == NO_ARGUMENTS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call_list(choice.message.tool_calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)

    respond(h, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert engine.params is not None and engine.params.structured_outputs is not None
    assert engine.params.structured_outputs.json["maxItems"] == 1


def test_required_streams_tool_call_deltas(tokenizer: Any) -> None:
    chunks = stream_chunks(handler(tokenizer, FakeEngine([REQUIRED_OUT])), tools=TOOLS, tool_choice="required")
    msg = reassemble(chunks)
    assert msg["content"] == "" and msg["finish_reason"] == "tool_calls"
    assert call_list(msg["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    entries = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", ())]
    assert (
        len([t for t in entries if "id" not in t]) > 2
    )  # the arguments arrived in pieces, as the engine produced them


def test_named_tool_constrains_to_its_parameters(tokenizer: Any) -> None:
    engine = FakeEngine(['{"city": "Paris"}'])
    h = handler(tokenizer, engine)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = respond(h, tools=TOOLS, tool_choice=named)
    assert engine.params is not None and engine.params.structured_outputs is not None
    assert engine.params.structured_outputs.json == WEATHER_SCHEMA
    assert engine.params.structured_outputs.field == "tool_choice"
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert call_list(out.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    msg = reassemble(stream_chunks(h, tools=TOOLS, tool_choice=named))
    assert call_list(msg["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    assert msg["finish_reason"] == "tool_calls"


def test_n_samples_each_get_their_calls(tokenizer: Any) -> None:
    engine = FakeEngine(['{"city": "Paris"}', '{"city": "Oslo"}'])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = respond(handler(tokenizer, engine), tools=TOOLS, tool_choice=named, n=2)
    assert [call_list(c.message.tool_calls) for c in out.choices] == [
        [("get_weather", {"city": "Paris"})],
        [("get_weather", {"city": "Oslo"})],
    ]
    assert out.choices[0].message.tool_calls[0].id != out.choices[1].message.tool_calls[0].id


# ----------------------------------------------------------------------------- auto


HERMES_OUT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_auto_parses_calls_with_the_configured_parser(tokenizer: Any) -> None:
    engine = FakeEngine([HERMES_OUT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'])
    h = handler(tokenizer, engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    out = respond(h, tools=TOOLS)  # tool_choice defaults to "auto" with tools
    assert engine.params is not None and engine.params.structured_outputs is None  # free text
    assert out.choices[0].message.content == "Checking."
    assert call_list(out.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert out.choices[0].finish_reason == "tool_calls"
    msg = reassemble(stream_chunks(h, tools=TOOLS, tool_choice="auto"))
    assert msg["content"] == "Checking." and msg["finish_reason"] == "tool_calls"
    assert call_list(msg["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    single = respond(h, tools=TOOLS, parallel_tool_calls=False)
    assert call_list(single.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]


def test_auto_without_a_call_is_plain_content(tokenizer: Any) -> None:
    h = handler(tokenizer, FakeEngine(["It is sunny."]), enable_auto_tool_choice=True, tool_call_parser="hermes")
    out = respond(h, tools=TOOLS, tool_choice="auto")
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].message.tool_calls == []
    assert out.choices[0].finish_reason == "stop"


def test_mistral_keeps_special_tokens_in_the_text(tokenizer: Any) -> None:
    engine = FakeEngine(['[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'])
    h = handler(tokenizer, engine, enable_auto_tool_choice=True, tool_call_parser="mistral")
    out = respond(h, tools=TOOLS)
    assert engine.params is not None and engine.params.skip_special_tokens is False
    assert call_list(out.choices[0].message.tool_calls) == [("get_time", {})]


def test_strict_tools_under_auto(tokenizer: Any) -> None:
    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}}]
    engine = FakeEngine([HERMES_OUT])
    respond(handler(tokenizer, engine, enable_auto_tool_choice=True, tool_call_parser="hermes"), tools=strict)
    so = engine.params.structured_outputs if engine.params else None
    assert so is not None and so.field == "tools" and so.structural_tag is not None
    assert so.structural_tag["triggers"] == ["<tool_call>"]
    (structure,) = so.structural_tag["structures"]
    assert structure["schema"] == WEATHER_SCHEMA
    assert structure["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert structure["end"] == "}\n</tool_call>"
    llama = handler(tokenizer, FakeEngine(["x"]), enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    with pytest.raises(RequestError, match="strict") as e:
        respond(llama, tools=strict)
    assert e.value.param == "tools"


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "enable-auto-tool-choice"),
        ({"tools": TOOLS}, "tool_choice", "enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "distinct"),
        ({"functions": [TOOLS[0]["function"]]}, "functions", "deprecated"),
        ({"function_call": "auto"}, "function_call", "deprecated"),
        ({"chat_template_kwargs": {"no_such_variable": 1}}, "chat_template_kwargs", "not read"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "cannot set"),
    ],
)
def test_refusals_name_the_field(tokenizer: Any, body: dict[str, Any], param: str, match: str) -> None:
    with pytest.raises((RequestError, OpenAIError), match=match) as e:
        respond(handler(tokenizer, FakeEngine(["x"])), **body)
    assert e.value.param == param


def test_a_tool_choice_constraint_does_not_combine_with_another(tokenizer: Any) -> None:
    from raytp.openai.chat import _with_tools
    from raytp.openai.tools import plan_tools
    from request.structured_outputs import StructuredOutputsParams

    plan = plan_tools(ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="required"), ChatSettings())
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True, field="response_format"))
    with pytest.raises(RequestError, match="response_format") as e:
        _with_tools(params, plan)
    assert e.value.param == "tool_choice"


def test_chat_settings_refuse_unknown_parsers() -> None:
    with pytest.raises(ValueError, match="registered: hermes, llama3_json, mistral"):
        ChatSettings(tool_call_parser="nope")
    with pytest.raises(ValueError, match="registered: deepseek_r1, qwen3"):
        ChatSettings(reasoning_parser="nope")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatSettings(enable_auto_tool_choice=True)


# ----------------------------------------------------------------------------- the template


def test_multi_turn_tool_conversation_goes_through_the_template(tokenizer: Any) -> None:
    engine = FakeEngine(["It is 21C in Paris."])
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    out = respond(handler(tokenizer, engine), messages=messages, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.content == "It is 21C in Paris." and out.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(engine.prompt_ids)
    assert prompt == (
        f"<tools>get_weather{json.dumps(WEATHER_SCHEMA)};get_time;</tools>"
        "<user>Weather in Paris?</user>"
        '<assistant><call call_1>get_weather{"city": "Paris"}</call></assistant>'
        '<tool>[call_1]{"temp": 21}</tool><assistant>'
    )
    assert engine.params is not None and engine.params.structured_outputs is None


def test_bad_earlier_arguments_are_refused(tokenizer: Any) -> None:
    bad = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{nope"}}]}
    with pytest.raises(OpenAIError, match="not JSON") as e:
        respond(handler(tokenizer, FakeEngine(["x"])), messages=[*USER, bad])
    assert e.value.param == "messages"


def test_chat_template_kwargs_reach_the_template(tokenizer: Any) -> None:
    engine = FakeEngine(["ok"])
    respond(handler(tokenizer, engine), chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(engine.prompt_ids) == "<no_think><user>Weather in Paris?</user><assistant>"


# ----------------------------------------------------------------------------- reasoning


def test_reasoning_content_is_split_out(tokenizer: Any) -> None:
    text = "<think>Paris is in France.</think>\n\nIt is sunny."
    h = handler(tokenizer, FakeEngine([text]), reasoning_parser="qwen3")
    out = respond(h)
    assert out.choices[0].message.reasoning_content == "Paris is in France."
    assert out.choices[0].message.content == "\n\nIt is sunny."
    chunks = stream_chunks(h)
    msg = reassemble(chunks)
    assert msg["reasoning_content"] == "Paris is in France." and msg["content"] == "\n\nIt is sunny."
    assert not any("<think" in c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_reasoning_then_auto_tool_calls(tokenizer: Any) -> None:
    text = "<think>Need weather.</think>\n" + HERMES_OUT
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"}
    h = handler(tokenizer, FakeEngine([text]), **settings)
    out = respond(h, tools=TOOLS)
    assert out.choices[0].message.reasoning_content == "Need weather."
    assert out.choices[0].message.content == "\nChecking."
    assert call_list(out.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    msg = reassemble(stream_chunks(h, tools=TOOLS))
    assert (msg["reasoning_content"], msg["content"]) == ("Need weather.", "\nChecking.")
    assert call_list(msg["tool_calls"]) == [("get_weather", {"city": "Paris"})]


def test_template_kwargs_with_named_templates() -> None:
    """A tokenizer may carry several named templates (a dict): a key any of them reads is accepted."""
    from types import SimpleNamespace

    rendered: list[dict[str, Any]] = []

    def apply_chat_template(convo: Any, **kw: Any) -> list[int]:
        rendered.append(kw)
        return [5]

    tok = SimpleNamespace(
        chat_template={"default": "{{ messages }}", "tool_use": "{{ messages }}{{ tools }}{{ builtin_tools }}"},
        apply_chat_template=apply_chat_template,
    )
    ctx = ServingContext(FakeEngine(["x"]), tok, "m", max_model_len=64, vocab_size=259, max_token_chars=4)
    msgs = ChatCompletionRequest(messages=USER).messages
    assert asyncio.run(ctx.chat_prompt_ids(msgs, True, None, {"builtin_tools": ["x"]})) == [5]
    assert rendered[-1]["builtin_tools"] == ["x"]
    with pytest.raises(OpenAIError, match="not read") as e:
        asyncio.run(ctx.chat_prompt_ids(msgs, True, None, {"other": 1}))
    assert e.value.param == "chat_template_kwargs"


def test_a_constraint_waits_for_the_reasoning_to_end(tokenizer: Any) -> None:
    """With a reasoning parser the constraint starts after `</think>`, unless the prompt already closed the
    reasoning section (Qwen3's template with enable_thinking=false); without one it starts at once."""
    engine = FakeEngine(['{"a": 1}'])
    fmt = {"type": "json_object"}
    respond(handler(tokenizer, engine, reasoning_parser="deepseek_r1"), response_format=fmt)
    assert engine.params is not None and engine.params.structured_outputs is not None
    assert engine.params.structured_outputs.start_after == "</think>"
    respond(handler(tokenizer, engine), response_format=fmt)
    assert engine.params.structured_outputs is not None and engine.params.structured_outputs.start_after is None
    template = tokenizer.chat_template
    tokenizer.chat_template = template + "<think>\n\n</think>\n\n"
    try:
        respond(handler(tokenizer, engine, reasoning_parser="qwen3"), response_format=fmt)
    finally:
        tokenizer.chat_template = template
    assert engine.params.structured_outputs is not None and engine.params.structured_outputs.start_after is None
