"""One chat-template renderer: the same conversation is the same prompt offline (`LLM.chat`) and over HTTP.

The conversation carries everything where the two roads once had different rules: text content parts, a
named message, an assistant's earlier tool call whose arguments are JSON text (a template writes them with
`tojson`, so text and object render differently), a tool answer, tools and a template variable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from raytp import LLM, SamplingParams
from raytp.chat_template import ChatTemplateError, render_chat
from raytp.openai.errors import OpenAIError
from raytp.openai.protocol import ChatCompletionRequest
from tests.helpers.tiny_models import make_tiny_llama
from tests.serving.test_chat_tools import TEMPLATE, TOOLS, FakeEngine, handler

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
    {"role": "user", "name": "ann", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE  # reads tools, enable_thinking, tool calls' arguments and tool_call_id
    tok.save_pretrained(path)
    return path


def http_prompt_ids(tokenizer: Any, **body: Any) -> list[int]:
    engine = FakeEngine(["ok"])
    asyncio.run(handler(tokenizer, engine).create(ChatCompletionRequest(max_tokens=1, **body), "chatcmpl-1"))
    return engine.prompt_ids


def test_offline_and_http_render_the_same_prompt(model_dir: str) -> None:
    llm = LLM(model_dir, max_model_len=512, kv_cache_memory_bytes=1 << 22, swap_space=0.01)
    try:
        kwargs = {"enable_thinking": False}
        (offline,) = llm.chat(
            CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS, chat_template_kwargs=kwargs
        )
        tokenizer = llm.get_tokenizer()
        body = {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": kwargs}
        http = http_prompt_ids(tokenizer, **body)  # tool_choice none: the tools still reach the template
        assert offline.prompt_token_ids == http
        text = tokenizer.decode(http)
        # the rules themselves, as both apply them
        assert text.startswith("<tools>get_weather") and "<no_think>" in text
        assert "<system>Be brief.\nUse tools.</system>" in text
        assert '<call call_1>get_weather{"city": "Paris"}</call>' in text  # an object, not quoted JSON text
        assert "<tool>[call_1]sunny</tool><assistant>" in text
        # without tools or variables, and without the generation prompt, the two still agree
        (bare,) = llm.chat(CONVERSATION[1:2], SamplingParams(max_tokens=1), use_tqdm=False)
        assert bare.prompt_token_ids == http_prompt_ids(tokenizer, messages=CONVERSATION[1:2])
        (cont,) = llm.chat(CONVERSATION[1:2], SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False)
        got = http_prompt_ids(tokenizer, messages=CONVERSATION[1:2], add_generation_prompt=False)
        assert cont.prompt_token_ids == got and not tokenizer.decode(got).endswith("<assistant>")
    finally:
        llm.llm_engine.shutdown()


def test_both_refuse_what_cannot_be_rendered(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.chat_template = TEMPLATE
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    call = {**CONVERSATION[2]["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}
    bad_args = [{**CONVERSATION[2], "tool_calls": [call]}]
    for messages, words in [(image, "type 'image_url' are not supported"), (bad_args, "are not JSON")]:
        with pytest.raises(ChatTemplateError, match=words):
            render_chat(tokenizer, messages)
        with pytest.raises(OpenAIError, match=words) as err:
            http_prompt_ids(tokenizer, messages=messages)
        assert err.value.status == 400 and err.value.param == "messages"
