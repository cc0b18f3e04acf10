"""Structured outputs over HTTP on a live server (embedded SmolLM2), through the official `openai` client and
a real agent library: parsed objects, 200 seeded samples that all validate, streaming, bad specs as 400s
naming the field, and a hostile schema that stalls nobody. After every test the engine is idle with every
device KV block free.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.serving.live_server import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=10_000_000)
    country: Literal["France", "Italy", "Spain"]
    # Every string bounded: a sample at temperature 1.0 must be able to end within max_tokens.
    districts: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(min_length=1, max_length=3)


@pytest.fixture(scope="module")
def server(shared_live_server: LiveServer) -> LiveServer:
    """The shared SMALL_ENGINE server (conftest.py): these tests only send requests and leave it idle."""
    return shared_live_server


@pytest.fixture(autouse=True)
def idle_after(server: LiveServer) -> Any:
    yield
    server.wait_idle()


def test_client_parse_returns_parsed_objects(server: LiveServer) -> None:
    """`chat.completions.parse(response_format=<pydantic model>)`: the client sends a strict json_schema."""
    completion = server.client().chat.completions.parse(
        model=MODEL, messages=ASK, response_format=City, temperature=1.0, seed=3, max_completion_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_two_hundred_seeded_samples_validate(server: LiveServer) -> None:
    """40 requests x n=5 at temperature 1.0, over four schemas (json_object is walked offline: an unbounded
    object may run past any max_tokens at temperature 1.0)."""
    schemas = [
        {**City.model_json_schema(), "additionalProperties": False},  # as the client's strict mode sends it
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}},
            "required": ["ok", "code"],
            "additionalProperties": False,
        },
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 5},
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-f0-9]{4,8}$"},
                "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
    ]

    async def one(client: openai.AsyncOpenAI, i: int) -> list[tuple[int, str, str | None]]:
        schema_id = i % len(schemas)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{schema_id}", "schema": schemas[schema_id]}}
        r = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=fmt,
            n=5,
            seed=i,
            temperature=1.0,
            max_tokens=200,  # type: ignore[arg-type]
        )
        return [(schema_id, c.message.content or "", c.finish_reason) for c in r.choices]

    async def run() -> list[tuple[int, str, str | None]]:
        client = server.async_client()
        results = await asyncio.gather(*(one(client, i) for i in range(40)))
        return [s for r in results for s in r]

    samples = asyncio.run(run())
    assert len(samples) == 200
    for schema_id, text, finish in samples:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schemas[schema_id])
    assert len({t for _, t, _ in samples}) > 100


def test_completions_and_guided_fields_and_streaming(server: LiveServer) -> None:
    client = server.client()
    r = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"[0-9]{2,4}"}},
    )
    assert re.fullmatch(r"[0-9]{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=10, temperature=0.0, extra_body={"guided_choice": ["left", "right"]}
    )
    assert r.choices[0].text in ("left", "right")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        stream=True,
        temperature=1.0,
        seed=5,
        max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}},
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    City.model_validate_json(text)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts_a_typed_object(server: LiveServer, mode: str) -> None:
    """A real agent library (instructor) on the live server: through response_format, and through a named
    tool_choice (instructor's default mode)."""
    import instructor

    client = instructor.from_openai(server.client(), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(
        model=MODEL, messages=ASK, response_model=City, temperature=1.0, seed=9, max_tokens=200, max_retries=0
    )
    assert isinstance(city, City)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ],
)
def test_bad_specs_are_400s_naming_the_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param  # type: ignore[index]


def test_hostile_schema_stalls_nobody(server: LiveServer) -> None:
    """A 100k-value enum is compiled off the engine loop and refused (400 naming the field) while a stream
    runs beside it; the stream gets every token, and nothing leaks (checked by idle_after)."""

    async def run() -> tuple[str | None, int, BaseException | None]:
        client = server.async_client()
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            stream=True,
            max_tokens=48,
            temperature=0.0,
            stream_options={"include_usage": True},
        )
        finish: str | None = None
        tokens = 0

        async def consume() -> None:
            nonlocal finish, tokens
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens

        schema = {"enum": list(range(100_000))}
        hostile = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": schema}},
        )
        results = await asyncio.gather(consume(), hostile, return_exceptions=True)
        return finish, tokens, results[1] if isinstance(results[1], BaseException) else None

    finish, tokens, error = asyncio.run(run())
    assert isinstance(error, openai.BadRequestError) and error.body["param"] == "response_format"  # type: ignore[index]
    assert finish == "length" and tokens == 48
