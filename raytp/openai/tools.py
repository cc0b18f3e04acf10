"""A chat request's tools, tool_choice and parallel_tool_calls -> what the chat handler does (vLLM's semantics).

    tool_choice        output                                   how the calls get there
    "none" / no tools  content                                  nothing parses it (tools still reach the template)
    "auto"             content and calls, by the server's        free text, parsed by --tool-call-parser; strict
                       tool-call parser                          tools add a structural-tag constraint
    "required"         a JSON array of {"name", "parameters"}    a JSON-schema constraint (anyOf over the tools)
    named              the function's arguments object           a JSON-schema constraint (its parameters)

Every constraint names `tool_choice` (or `tools`, for strict tools under auto), so a schema the grammar
compiler refuses is a 400 naming the field it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytp.openai.chat_settings import ChatSettings
from raytp.openai.protocol import ChatTool, NamedToolChoice, ToolFields
from raytp.openai.tool_parsers import TOOL_PARSERS, ToolParser
from raytp.openai.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from request.errors import RequestError
from request.structured_outputs import StructuredOutputsParams

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # `tools=` for the chat template, in OpenAI's shape
    parser: ToolParser | None  # reads the calls out of the output; None: the output is all content
    max_calls: int | None  # 1 when parallel_tool_calls is false: later calls are dropped
    constraint: StructuredOutputsParams | None  # what shapes the output into calls


def plan_tools(req: ToolFields, settings: ChatSettings) -> ToolPlan:
    """Raises RequestError (a 400 naming the field) for a combination vLLM refuses too."""
    # The deprecated functions/function_call are refused with the other unsupported fields (contract.py).
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError("tools must have distinct function names.", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise RequestError("tool_choice needs tools: send the functions the model may call.", "tool_choice")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(template_tools, None, None, None)
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise RequestError(
                f"tool_choice names {choice.function.name!r}, which is not one of the tools ({', '.join(names)}).",
                "tool_choice",
            )
        constraint = StructuredOutputsParams(json=_parameters(tool), field="tool_choice")
        return ToolPlan(template_tools, NamedCallParser(tool.function.name), 1, constraint)
    if choice == "required":
        constraint = StructuredOutputsParams(json=required_schema(tools, parallel), field="tool_choice")
        return ToolPlan(template_tools, RequiredCallsParser(), None, constraint)
    if not settings.auto_tool_choice:
        raise RequestError(
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
            '--tool-call-parser (tool_choice defaults to "auto" when tools are given).',
            "tool_choice",
        )
    assert settings.tool_call_parser is not None
    parser = TOOL_PARSERS.create(settings.tool_call_parser)
    return ToolPlan(template_tools, parser, None if parallel else 1, _strict_constraint(tools, parser, settings))


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """One or more calls (exactly one when parallel_tool_calls is false), each of one of the tools."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _strict_constraint(
    tools: list[ChatTool], parser: ToolParser, settings: ChatSettings
) -> StructuredOutputsParams | None:
    """strict tools under "auto": the arguments of a call, once the model opens one, follow its schema."""
    if not any(t.function.strict for t in tools):
        return None
    tag = parser.structural_tag({t.function.name: _parameters(t) for t in tools})
    if tag is None:
        raise RequestError(
            f"strict function tools under tool_choice auto need a tool-call parser that can constrain its "
            f"calls (hermes); this server's is {settings.tool_call_parser}. Send strict: false, or "
            f'tool_choice "required" or a named function.',
            "tools",
        )
    return StructuredOutputsParams(structural_tag=tag, field="tools")
