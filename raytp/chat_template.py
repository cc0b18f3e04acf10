"""The one chat-template renderer: a conversation (OpenAI's message shape) to prompt token ids.

Both roads to a chat prompt use it, so the same conversation is the same prompt offline (`LLM.chat`) and
over HTTP (`/v1/chat/completions`, raytp/openai/context.py); tests/serving/test_chat_render.py holds them
equal. The rules, vLLM's where it has them:
- a message reaches the template as {role, content, name?, tool_calls?, tool_call_id?}; `content` is text:
  None is "", a list of parts is their texts joined by newlines (a part that is not text is refused);
- an earlier tool call's `arguments` reach the template as an object (templates write them with `tojson`),
  though OpenAI's clients send them as JSON text;
- `tools` and the template variables (`template_kwargs`, e.g. enable_thinking) go in beside the messages.
The HTTP layer adds its own limits (prompt size, which template variables a request may set) before this.
Torch-free: the HTTP replica and the offline front door both import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; the message is for the user (HTTP answers it as a 400)."""


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """`message` (an OpenAI chat message as a dict) as chat templates read it. Idempotent."""
    out: dict[str, Any] = {"role": message["role"], "content": _content_text(message.get("content"))}
    if message.get("name") is not None:  # templates that know names use it; others ignore it
        out["name"] = message["name"]
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def render_chat(
    tokenizer: Any,
    messages: Iterable[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """The conversation through the tokenizer's chat template (or `chat_template`), as token ids.
    Raises ChatTemplateError for a message it cannot render and for a model without a template; errors
    raised inside the template itself (jinja2's TemplateError, a template's raise_exception) pass through."""
    convo = [template_message(m) for m in messages]
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("This model has no chat template; use /v1/completions.")
    extra = dict(template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    ids = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind, text = part.get("type"), part.get("text")
        if kind != "text" or text is None:
            raise ChatTemplateError(f"messages content parts of type {kind!r} are not supported (text only).")
        parts.append(text)
    return "\n".join(parts)


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatTemplateError(f"messages: the arguments of tool call {call.get('id')!r} are not JSON.") from None
    function_out = {"name": function["name"], "arguments": arguments}
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function_out}
