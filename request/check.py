"""The one check of a request against the model and the engine's limits, before anything is allocated.

SamplingParams already validated itself (value ranges); what needs the model or the engine is
checked here, once per request, by the engine's `add_request` — every entry point (offline `LLM`,
the HTTP service, batch jobs) goes through it, and none repeats it. Each failure is a typed
`RequestError` naming the field, so callers map it without reading the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from request.errors import PromptTooLongError, RequestError
from request.sampling_params import TOKEN_ID_FIELDS, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_model_len: int  # the prompt plus at least one generated token must fit
    max_num_seqs: int  # a request's best_of sequences are scheduled together, so at most this many
    max_prompt_tokens: int  # the longest prompt the KV pool can ever hold (blocks less the watermark)


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise RequestError (PromptTooLongError for length) unless the engine can serve this request."""
    if not prompt_token_ids:
        raise RequestError("prompt must not be empty.", "prompt")
    vocab = limits.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise RequestError(f"prompt token ids must be in [0, {vocab}) (the vocabulary size).", "prompt")
    num = len(prompt_token_ids)
    if num >= limits.max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your prompt is "
            f"{num} tokens long, which leaves no room for a completion."
        )
    if num > limits.max_prompt_tokens:
        raise PromptTooLongError(
            f"The prompt is {num} tokens long; the KV cache of this server can hold at most "
            f"{limits.max_prompt_tokens} tokens for one request."
        )
    for name in TOKEN_ID_FIELDS:
        bad = [t for t in getattr(params, name) or () if t >= vocab]
        if bad:
            raise RequestError(f"{name} token ids outside the vocabulary [0, {vocab}): {bad[:5]}.", name)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab:
            raise RequestError(f"{name} must be at most the vocabulary size ({vocab}), got {k}.", name)
    if params.actual_best_of > limits.max_num_seqs:
        # More samples than one step holds would never be admitted and would block the waiting queue.
        name = "best_of" if params.best_of is not None and params.best_of > params.n else "n"
        raise RequestError(
            f"{name} must be at most max_num_seqs ({limits.max_num_seqs}), got {params.actual_best_of}.", name
        )
