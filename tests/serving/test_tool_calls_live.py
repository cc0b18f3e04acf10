"""Tool calling on a live server (embedded SmolLM2, TP=1), through the official `openai` client.

`required` and named tool choice are enforced by the engine's grammar constraint: every call's arguments
validate against the tool's schema, streamed or not.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.serving.live_server import LiveServer

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server(shared_live_server: LiveServer) -> LiveServer:
    """The shared SMALL_ENGINE server (conftest.py): these tests only send requests and leave it idle."""
    return shared_live_server


@pytest.fixture(autouse=True)
def idle_after(server: LiveServer) -> Any:
    yield
    server.wait_idle()


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_gives_valid_arguments(server: LiveServer) -> None:
    resp = server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        seed=1,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    check_calls([(c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_required_reassembles_into_valid_calls(server: LiveServer, parallel: bool) -> None:
    stream = server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        # Parallel calls form an array with no upper bound: room for several, at a temperature that ends it.
        max_tokens=400,
        temperature=0.7,
        seed=3,
        stream=True,
    )
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                assert tc.function is not None
                if tc.index not in calls:
                    assert tc.id and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert parallel or len(calls) == 1
    check_calls([(name, args) for name, args in calls.values()])


def test_a_tool_conversation_reaches_the_template(server: LiveServer) -> None:
    """Assistant tool calls and tool results are accepted and rendered (SmolLM2's template ignores tools)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages: Any = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    resp = server.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert resp.choices[0].message.tool_calls in (None, [])
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: this server has no tool-call parser
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ],
)
def test_tool_refusals_are_400s_naming_the_field(server: LiveServer, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body=extra,
        )
    assert e.value.status_code == 400
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == param
