"""What every route handler of one ingress replica shares: the model's identity and tokenizer."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.output_processor import IncrementalDetokenizer
from cluster.serving.errors import OpenAIError, bad_request
from cluster.serving.generation import Generation
from cluster.serving.protocol import ChatMessageIn
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event exactly as OpenAI frames it: `data: {json}` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class ServingContext:
    server: DeploymentHandle  # the LLMServer deployment (Serve balances across its replicas)
    tokenizer: Any
    model_name: str  # the name clients must send as `model`
    max_model_len: int
    vocab_size: int
    max_num_seqs: int  # the most samples one request may ask for (they are scheduled together)

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.streaming_server = self.server.options(stream=True)  # made once: options() builds a new handle
        # One decode per distinct token id; logprobs ask for the same tokens over and over.
        self.decode_token = functools.lru_cache(maxsize=65536)(self._decode_token)

    def _decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise OpenAIError(
                f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                404,
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def generation(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Generation:
        return Generation(self.streaming_server, request_id, prompt_token_ids, params, self.detok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt_ids(self, messages: Iterable[ChatMessageIn], add_generation_prompt: bool) -> list[int]:
        """The conversation through the model's chat template (as `LLM.chat` does offline)."""
        convo = [{"role": m.role, "content": _content_text(m)} for m in messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions.", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # jinja's TemplateError and friends: the conversation does not fit the template
            raise bad_request(f"messages could not be rendered by the chat template: {e}", "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def _content_text(m: ChatMessageIn) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for p in m.content:
        if p.type != "text" or p.text is None:
            raise bad_request(f"messages content parts of type {p.type!r} are not supported (text only).", "messages")
        parts.append(p.text)
    return "\n".join(parts)
