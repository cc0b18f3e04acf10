"""The request shapes of constrained output: OpenAI's `response_format` and vLLM's `structured_outputs`.

Only shapes live here (pydantic, so a malformed spec is a 400 naming the top-level field); which
source a request used and what it becomes is decided in `requests.structured_outputs`. Whether a
schema, regex or grammar compiles is the engine's word (a 400 naming the same field).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from raytp.openai.base import OpenAIRequest


class JsonSchemaFormat(OpenAIRequest):
    """OpenAI's `response_format.json_schema`. `name` and `description` tell the model nothing here
    (raytp does not put them in the prompt, nor does vLLM); `strict: false` still constrains, as in vLLM."""

    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute: the alias is the wire name.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (vLLM's shape): free text in which each trigger opens a region that follows a schema
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsIn(OpenAIRequest):
    """vLLM's `structured_outputs` request object, under vLLM's names (scheduler's StructuredOutputsParams)."""

    # `json` shadows a BaseModel attribute: the alias is the wire name.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # raytp has one backend, so there is never a fallback to disable: true and false are both honoured.
    disable_fallback: bool = False
