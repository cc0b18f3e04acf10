"""The request shapes of constrained output: OpenAI's `response_format` and vLLM's `structured_outputs`.

Only shapes live here (pydantic, so a malformed spec, down to a structural tag's `begin`, is a 400 naming
the top-level field, before anything reads it); which
source a request used and what it becomes is decided in `requests.structured_outputs`. Whether a
schema, regex or grammar compiles is the engine's word (a 400 naming the same field).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from raytp.openai.base import OpenAIRequest


class JsonSchemaFormat(OpenAIRequest):
    """OpenAI's `response_format.json_schema`. `name` and `description` tell the model nothing here
    (raytp does not put them in the prompt, nor does vLLM); `strict: false` still constrains, as in vLLM."""

    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute: the alias is the wire name.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TagStructure(OpenAIRequest):
    """One structure of vLLM's structural tag: a region that opens with `begin` (which starts with one of
    the triggers), follows `schema` and closes with `end`."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class StructuralTag(OpenAIRequest):
    """vLLM's structural tag (`structured_outputs.structural_tag`): free text in which each trigger opens a
    region that must be one of the structures."""

    structures: list[TagStructure] = Field(min_length=1)
    triggers: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        """vLLM also takes the tag as JSON text: parsed here, so its fields are checked the same way."""
        if isinstance(data, str):
            try:
                return json.loads(data)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"structural_tag is not valid JSON: {e}") from None
        return data


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type "structural_tag" (vLLM's shape): free text in which each trigger opens a region that follows a schema
    structures: Annotated[list[TagStructure], Field(min_length=1)] | None = None
    triggers: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None


class StructuredOutputsIn(OpenAIRequest):
    """vLLM's `structured_outputs` request object, under vLLM's names (scheduler's StructuredOutputsParams)."""

    # `json` shadows a BaseModel attribute: the alias is the wire name.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: StructuralTag | None = None  # an object or its JSON text
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # raytp has one backend, so there is never a fallback to disable: true and false are both honoured.
    disable_fallback: bool = False
