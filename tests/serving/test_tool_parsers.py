"""Tool-call and reasoning parsers without a model: whole-text results, and streams over every split.

The stream must add up to the whole-text result for every way the text can arrive: fed whole, in
every pair of pieces, one character at a time, and in random pieces.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from raytp.openai.chat_output import Message, SampleParser, fold
from raytp.openai.reasoning import REASONING_PARSERS
from raytp.openai.tool_parsers import TOOL_PARSERS
from raytp.openai.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from raytp.openai.tool_parsers.json_scan import scan_members, scan_value

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}}'


def whole(make: Any, text: str) -> Message:
    return fold(make().feed(text, True))


def pieces_of(text: str, seed: int) -> list[list[str]]:
    """Every split into two pieces, one character at a time, and a few random splits."""
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    splits.append(list(text) or [""])
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(5, max(len(text) - 1, 1))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return splits


def streamed(make: Any, pieces: list[str]) -> Message:
    parser = make()
    deltas: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        deltas.extend(parser.feed(piece, i == len(pieces) - 1))
    for d in deltas:  # the shape OpenAI streams: id, type and name first, then argument fragments only
        for entry in d.get("tool_calls", ()):
            assert set(entry) in ({"index", "id", "type", "function"}, {"index", "function"})
            if "id" in entry:
                assert entry["function"]["arguments"] == "" and entry["function"]["name"]
            else:
                assert set(entry["function"]) == {"arguments"} and entry["function"]["arguments"]
        assert not any(v == "" for v in d.values())
    return parser_message(deltas)


def parser_message(deltas: list[dict[str, Any]]) -> Message:
    msg = fold(deltas)
    for c in msg.tool_calls:
        c["id"] = "<id>"  # ids are random
    return msg


def check_streams(make: Any, text: str) -> Message:
    expected = parser_message(make().feed(text, True))
    for pieces in pieces_of(text, seed=len(text)):
        assert streamed(make, pieces) == expected, pieces
    return expected


def calls(msg: Message) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls]


def tool_sampler(name: str, max_calls: int | None = None) -> Any:
    return lambda: SampleParser(None, TOOL_PARSERS.create(name), max_calls)


# ----------------------------------------------------------------------------- the JSON scanner


def test_scanner_reports_complete_arriving_and_broken_values() -> None:
    assert scan_value('{"a": [1, "]"]} tail', 0, False) == (15, True)
    assert scan_value('{"a": [1, "]"', 0, False) == (13, False)
    assert scan_value("{]", 0, False).broken("{]")
    assert scan_value("123", 0, False) == (3, False) and scan_value("123", 0, True) == (3, True)
    assert scan_value(r'"a\\"b', 0, False) == (5, True)  # an escaped backslash, then the closing quote
    assert scan_value(r'"a\"', 0, False) == (4, False)  # an escaped quote: still open
    assert scan_value(r'{"k": "}\n{"}', 0, False) == (13, True)
    members = scan_members('{"name": "f", "arguments": {"x": 1', 0, False)
    assert set(members.values) == {"name", "arguments"} and not members.scan.complete
    assert members.values["arguments"][1] == (34, False)


# ----------------------------------------------------------------------------- tool-call parsers


def test_registry_names_and_refusal() -> None:
    assert TOOL_PARSERS.names() == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        TOOL_PARSERS.create("nope")


HERMES = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
    f"<tool_call>{WEATHER}</tool_call>\n",
    "No tools needed: 1 < 2 and <tool is not a tag.",
    '<tool_call>\n{"arguments": {"q": "</tool_call>"}, "name": "search"}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call> </tool',
    "<tool_call>not json</tool_call>Fine.",
    '<tool_call>{"name": tru}</tool_call><tool_call>{"name": {"x": [}, "arguments": {}}</tool_call>'
    '<tool_call>{"name": "\\x"}</tool_call>',
    '<tool_call>{"name": "a", "parameters": {"p": 1}, "arguments": {"q": 2}, "name": "b"}</tool_call>',
]


@pytest.mark.parametrize("text", HERMES)
def test_hermes_streams_equal_whole_text(text: str) -> None:
    check_streams(tool_sampler("hermes"), text)


def test_hermes_whole_text() -> None:
    msg = whole(tool_sampler("hermes"), HERMES[0])
    assert msg.content == "Let me check."
    weather = {"city": "Paris", "days": [1, 2], "note": 'a "}" b'}
    assert calls(msg) == [("get_weather", weather), ("get_time", {"tz": "CET"})]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c["id"]) for c in msg.tool_calls)
    assert whole(tool_sampler("hermes"), HERMES[1]).content is None
    assert whole(tool_sampler("hermes"), HERMES[2]) == Message(None, HERMES[2], [])
    assert calls(whole(tool_sampler("hermes"), HERMES[3])) == [("search", {"q": "</tool_call>"})]
    unclosed = whole(tool_sampler("hermes"), HERMES[4])  # the first call's closing tag is missing
    assert calls(unclosed) == [("a", {}), ("b", {})] and unclosed.content == " </tool"
    assert whole(tool_sampler("hermes"), HERMES[5]) == Message(None, "Fine.", [])
    assert whole(tool_sampler("hermes"), HERMES[6]) == Message(None, "", [])  # names that are not strings
    assert calls(whole(tool_sampler("hermes"), HERMES[7])) == [("a", {"p": 1})]  # duplicate keys: the first
    assert len(whole(tool_sampler("hermes", max_calls=1), HERMES[0]).tool_calls) == 1


LLAMA = [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    '{"name": "get_weather", "parameters": {"city": "Oslo", "n": 12}}',
    '{"city": "Paris", "temperature": 21}',
    "Plain answer {with braces}.",
    "<|python",
]


@pytest.mark.parametrize("text", LLAMA)
def test_llama3_json_streams_equal_whole_text(text: str) -> None:
    check_streams(tool_sampler("llama3_json"), text)


def test_llama3_json_whole_text() -> None:
    msg = whole(tool_sampler("llama3_json"), LLAMA[0])
    assert msg.content is None
    assert calls(msg) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls(whole(tool_sampler("llama3_json"), LLAMA[1])) == [("get_weather", {"city": "Oslo", "n": 12})]
    for text in LLAMA[2:]:  # JSON without a name, and text, are content
        assert whole(tool_sampler("llama3_json"), text) == Message(None, text, [])


MISTRAL = [
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
    '[TOOL_CALLS][{"name": "f", "arguments": {}}]',
    "No [TOOL tags here.",
]


@pytest.mark.parametrize("text", MISTRAL)
def test_mistral_streams_equal_whole_text(text: str) -> None:
    check_streams(tool_sampler("mistral"), text)


def test_mistral_whole_text() -> None:
    msg = whole(tool_sampler("mistral"), MISTRAL[0])
    assert msg.content == "Sure."
    assert calls(msg) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in msg.tool_calls)
    assert TOOL_PARSERS.create("mistral").needs_special_tokens
    assert whole(tool_sampler("mistral"), MISTRAL[2]).content == MISTRAL[2]


def test_forced_tool_choice_outputs() -> None:
    named = lambda: SampleParser(None, NamedCallParser("get_weather"), None)  # noqa: E731
    msg = check_streams(named, ' {"city": "Paris"} ')
    assert msg.content is None and calls(msg) == [("get_weather", {"city": "Paris"})]
    required = lambda: SampleParser(None, RequiredCallsParser(), None)  # noqa: E731
    text = '[{"name": "a", "parameters": {"x": [1]}}, {"name": "b", "parameters": {}}]'
    assert calls(check_streams(required, text)) == [("a", {"x": [1]}), ("b", {})]


def test_a_cut_off_call_keeps_what_arrived() -> None:
    """max_tokens can end a call mid-arguments: the stream and the whole text still agree."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1'
    msg = check_streams(tool_sampler("hermes"), text)
    assert msg.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}


# ----------------------------------------------------------------------------- reasoning parsers


def reasoning_sampler(name: str, tools: str | None = None) -> Any:
    return lambda: SampleParser(REASONING_PARSERS.create(name), TOOL_PARSERS.create(tools) if tools else None, None)


def test_reasoning_registry() -> None:
    assert REASONING_PARSERS.names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        REASONING_PARSERS.create("nope")


REASONING = [
    "<think>2 < 3, so</think>\n\nThe answer is 3.",
    "the template opened the tag</think>Answer.",
    "<think>still thinking when cut",
    "No reasoning at all.",
    "<thi",
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", REASONING)
def test_reasoning_streams_equal_whole_text(name: str, text: str) -> None:
    check_streams(reasoning_sampler(name), text)


def test_reasoning_whole_text() -> None:
    r1, qwen3 = reasoning_sampler("deepseek_r1"), reasoning_sampler("qwen3")
    assert whole(r1, REASONING[0]) == Message("2 < 3, so", "\n\nThe answer is 3.", [])
    assert whole(qwen3, REASONING[0]) == Message("2 < 3, so", "\n\nThe answer is 3.", [])
    assert whole(r1, REASONING[1]) == Message("the template opened the tag", "Answer.", [])
    assert whole(qwen3, REASONING[1]) == Message(None, REASONING[1], [])
    assert whole(r1, REASONING[2]) == Message("still thinking when cut", "", [])
    assert whole(qwen3, REASONING[3]) == Message(None, REASONING[3], [])


def test_reasoning_then_tool_calls() -> None:
    text = f"<think>I need the weather.</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>"
    msg = check_streams(reasoning_sampler("qwen3", "hermes"), text)
    assert msg.reasoning_content == "I need the weather." and msg.content is None
    assert [name for name, _ in calls(msg)] == ["get_weather"]
