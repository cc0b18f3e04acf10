"""What every route handler shares about one served model (`ServingContext`): the engine client, the
model's identity and its tokenizer, the LoRA adapter a request runs with, and SSE framing. Which
context a request gets, by its `model`, is `ServedModels`' decision (models.py).

Tokenizing user input can take long (a prompt of megabytes), so it never runs on the event loop:
`encode`, `chat_prompt_ids` and `decode` run in a small thread pool of their own, and a prompt with
more characters than `max_model_len` tokens could ever hold is refused before it is tokenized at all
(a token's text is at most `max_token_chars` characters long).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2.meta
import jinja2.sandbox
from jinja2.exceptions import TemplateError

from cluster.pooling import encode_truncated, pair_token_ids
from raytp.chat_template import ChatTemplateError, render_chat, template_message
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.engine_client import EngineClient, EngineRequest
from raytp.openai.errors import bad_request
from raytp.openai.protocol import ChatMessageIn
from raytp.openai.stream import RequestStream
from request.errors import PromptTooLongError
from request.lora import LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_TOKENIZER_THREADS = 2


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event exactly as OpenAI frames it: `data: {json}` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def max_token_chars(tokenizer: Any) -> int:
    """The longest text any single token decodes to (bounds how many characters a token can cover)."""
    backend = tokenizer.backend_tokenizer
    return max(1, *(len(backend.decode([i], skip_special_tokens=False)) for i in range(backend.get_vocab_size())))


@dataclass
class ServingContext:
    client: EngineClient  # reaches the model replicas
    tokenizer: Any
    model_name: str  # the name clients send as `model`, and responses carry (an adapter's own name)
    max_model_len: int
    vocab_size: int
    max_token_chars: int  # see max_token_chars()
    chat: ChatSettings = field(default_factory=ChatSettings)  # tool-call and reasoning parsers (vLLM's flags)
    # the model's sampling defaults (the engine's `generation_defaults`): what a request's unset field takes
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    enable_lora: bool = False  # the engine serves LoRA adapters (EngineConfig.enable_lora)
    # a pooling model's task (the engine's `pooling_task`: "embed" or "score"); None: the model generates
    pooling_task: str | None = None
    # what the model's weights run (the engine's `quantization`, every rank's): /v1/models shows it
    quantization: str = "none"
    # the adapter every request through this context runs with (None: the base model); set by `with_adapter`
    lora: LoRARequest | None = None
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="raytp-tokenize")
    )

    def __post_init__(self) -> None:
        # One decode per distinct token id (echo's first prompt token has no logprob entry to carry its text).
        self.decode_token = functools.lru_cache(maxsize=65536)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def with_adapter(self, lora: LoRARequest) -> ServingContext:
        """This model's context for requests that run with `lora`: the same tokenizer, engine client and
        tokenizer threads, answering under the adapter's name."""
        return dataclasses.replace(self, model_name=lora.lora_name, lora=lora)

    def stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> RequestStream:
        """Engine request ids must be unique in the engine while a client's `X-Request-Id` need not be
        (two clients may send the same one): the engine id is the public id plus a random suffix, so a
        log line still names the request by its prefix."""
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        return RequestStream(self.client, EngineRequest(engine_id, prompt_token_ids, params, self.lora))

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_model_len * self.max_token_chars:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens; your {param} has "
                f"{num_chars} characters, more than that many tokens can hold.",
                param,
            )

    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt", keep: int | None = None
    ) -> list[int]:
        """`keep` (pooling's truncate_prompt_tokens, resolved): at most that many tokens, the text cut from the
        left; a text of any length may ask for that (the body limit bounds the tokenizer's work)."""
        if keep is not None:
            return await self._off_loop(encode_truncated, self.tokenizer, text, keep, add_special_tokens)
        self._check_chars(len(text), param)
        ids = await self._off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)

    async def tokenize_pair(self, first: str, second: str, keep: int | None = None) -> list[int]:
        """A cross-encoder's (query, document) input, as its tokenizer pairs them (cluster/pooling.py)."""
        if keep is None:
            self._check_chars(len(first) + len(second), "text_2")
        return await self._off_loop(pair_token_ids, self.tokenizer, first, second, keep)

    async def decode(self, ids: list[int]) -> str:
        return str(await self._off_loop(self.tokenizer.decode, ids))

    async def chat_prompt_ids(
        self,
        messages: Iterable[ChatMessageIn],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the model's chat template (as `LLM.chat` does offline), with the
        request's `tools` and `chat_template_kwargs` (template variables such as enable_thinking)."""
        convo = [chat_message(m) for m in messages]
        self._check_chars(sum(map(_chars, convo)) + (_chars(tools) if tools else 0), "messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions.", "messages")
        if template_kwargs:
            self._check_template_kwargs(template_kwargs)
        try:
            ids = await self._off_loop(
                render_chat, self.tokenizer, convo, add_generation_prompt, tools, template_kwargs
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        except TemplateError as e:  # the template's own refusal (raise_exception): its words are for the user
            raise bad_request(f"messages could not be rendered by the chat template: {e}", "messages") from None
        except Exception:  # a Python error inside the template: its text is an internal, not for the client
            logger.warning("chat template failed on a request's messages", exc_info=True)
            raise bad_request("messages could not be rendered by the chat template.", "messages") from None
        return ids

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Each key must be a variable the template reads and not one the server sets itself: a key the
        template never reads would be accepted and ignored."""
        reserved = sorted(set(kwargs) & _SERVER_TEMPLATE_ARGS)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: the request's own fields do.",
                "chat_template_kwargs",
            )
        template = self.tokenizer.chat_template
        templates = template.values() if isinstance(template, dict) else [template]  # named templates: any
        unused = sorted(set(kwargs).difference(*map(template_variables, templates)))
        if unused:
            raise bad_request(
                f"chat_template_kwargs {', '.join(unused)}: not read by this model's chat template.",
                "chat_template_kwargs",
            )


# apply_chat_template's own arguments and the variables the server fills from the request's fields
_SERVER_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
     "return_dict", "return_tensors", "continue_final_message", "padding", "truncation", "max_length",
     "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its context."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def chat_message(m: ChatMessageIn) -> dict[str, Any]:
    """A message as chat templates read it: the rules `LLM.chat` follows too (raytp/chat_template.py)."""
    try:
        return template_message(m.model_dump(exclude_none=True))
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None


def _chars(value: Any) -> int:
    """Characters the template may write for a message or the tools (bounds the prompt's length)."""
    if isinstance(value, dict) and set(value) == {"role", "content"}:
        return len(value["role"]) + len(value["content"])
    return len(json.dumps(value, ensure_ascii=False))
