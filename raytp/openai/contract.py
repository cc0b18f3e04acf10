"""The request fields raytp declares but cannot honour: refused with a 400 naming them unless neutral.

The contract (docs/openai_contract.md states it for users): every declared request field is either
honoured (requests.py maps it to SamplingParams or the handlers use it), accepted as metadata that
cannot change the output (`METADATA`), or listed here. A refused field is still declared, so a client
sending its neutral value (`"use_beam_search": false`, `"store": false`, `"n": null`) is served,
and one asking for behaviour raytp lacks hears so instead of getting a different answer silently.
tests/serving/test_request_contract.py walks every declared field and holds the code to this.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytp.openai.protocol import ChatCompletionRequest, SamplingFields
from request.errors import RequestError


@dataclass(frozen=True)
class Refusal:
    neutral: Callable[[Any], bool]  # the values that ask for nothing raytp lacks
    reason: str  # said to the client


def _absent(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


# Accepted and without effect on the output, by design (each says why where it is declared); nested
# fields by their dotted path. `model` is checked against the served name (404 otherwise).
METADATA = frozenset(
    {
        "model",
        "user",
        "metadata",
        "safety_identifier",
        "prompt_cache_key",
        "guided_decoding_backend",  # only the values raytp's one backend answers to (else refused)
        "stream_options.include_obfuscation",
        "structured_outputs.disable_fallback",
        "response_format.json_schema.name",
        "response_format.json_schema.description",
        "response_format.json_schema.strict",
    }
)

COMMON: dict[str, Refusal] = {
    "use_beam_search": Refusal(_false, "raytp has no beam search."),
    "length_penalty": Refusal(lambda v: v == 1.0, "length_penalty applies to beam search, which raytp lacks."),
    "prompt_logprobs": Refusal(
        _absent, "raytp's HTTP API does not return prompt logprobs; on /v1/completions use echo with logprobs."
    ),
    "allowed_token_ids": Refusal(_absent, "raytp's sampler has no allowed-token mask."),
    "bad_words": Refusal(_absent, "raytp's sampler has no bad-words filter."),
    "priority": Refusal(lambda v: v == 0, "raytp schedules requests first come, first served."),
    "request_id": Refusal(_absent, "send the X-Request-Id header to name a request."),
    "logits_processors": Refusal(_absent, "raytp runs no per-request logits processors."),
    "return_tokens_as_token_ids": Refusal(_false, "raytp returns logprob tokens as text only."),
    "return_token_ids": Refusal(_false, "raytp's responses carry no token ids."),
    # Ignoring a salt would silently share cached prefixes the client asked to keep apart.
    "cache_salt": Refusal(_absent, "raytp's prefix cache has no per-request salt."),
    "kv_transfer_params": Refusal(_absent, "raytp has no disaggregated prefill."),
    "vllm_xargs": Refusal(_absent, "raytp takes no extra engine arguments per request."),
    "store": Refusal(_false, "raytp stores no completions."),
    "service_tier": Refusal(lambda v: v in (None, "auto", "default"), "raytp serves one tier ('auto' or 'default')."),
}
COMPLETIONS: dict[str, Refusal] = {
    "suffix": Refusal(lambda v: not v, "raytp has no fill-in-the-middle."),
    "prompt_embeds": Refusal(_absent, "raytp takes prompts as text or token ids only."),
}
CHAT: dict[str, Refusal] = {
    "modalities": Refusal(lambda v: v is None or v == ["text"], "raytp generates text only."),
    "audio": Refusal(_absent, "raytp generates text only."),
    "prediction": Refusal(_absent, "raytp has no predicted outputs."),
    "reasoning_effort": Refusal(_absent, "raytp's chat templates take no reasoning effort."),
    "verbosity": Refusal(_absent, "raytp has no verbosity control."),
    "web_search_options": Refusal(_absent, "raytp has no web search."),
    "echo": Refusal(_false, "raytp does not echo the last message on /v1/chat/completions."),
    "continue_final_message": Refusal(_false, "raytp's chat templates always start a new message."),
    "add_special_tokens": Refusal(_false, "the chat template places the special tokens."),
    "documents": Refusal(_absent, "raytp's chat templates take no documents."),
    "chat_template": Refusal(_absent, "raytp renders with the model's own chat template."),
    "mm_processor_kwargs": Refusal(_absent, "raytp serves text-only models."),
    # Legacy clients read `message.function_call`, which raytp does not return: refuse rather than answer
    # in a shape they ignore.
    "functions": Refusal(_absent, "functions is deprecated; send tools."),
    "function_call": Refusal(_absent, "function_call is deprecated; send tool_choice."),
}


def refusals(req: SamplingFields) -> dict[str, Refusal]:
    return {**COMMON, **(CHAT if isinstance(req, ChatCompletionRequest) else COMPLETIONS)}


def check_refused(req: SamplingFields) -> None:
    """Raises RequestError (-> 400 naming the field) for the first field asking what raytp cannot do."""
    for name, refusal in refusals(req).items():
        value = getattr(req, name)
        if not refusal.neutral(value):
            raise RequestError(f"{name}={reprlib.repr(value)} is not supported: {refusal.reason}", name)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise RequestError(
            "stream_options.continuous_usage_stats is not supported: raytp sends usage in the last chunk only.",
            "stream_options",
        )
