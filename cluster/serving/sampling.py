"""OpenAI request fields -> SamplingParams, and the length checks that need the prompt.

SamplingParams validates the values itself (its ValueError messages start with the field
name, which errors.py turns into a 400 with that `param`); here only the OpenAI-specific
translation happens: defaults, JSON-string logit_bias keys, max_tokens against max_model_len.
"""

from __future__ import annotations

from typing import Any

from cluster.serving.errors import bad_request
from cluster.serving.protocol import SamplingFields
from scheduler.sampling_params import SamplingParams


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, param: str) -> None:
    if not ids:
        raise bad_request(f"{param} must not be empty.", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise bad_request(f"{param} token ids must be in [0, {vocab_size}) (the vocabulary size).", param)
    if len(ids) >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your {param} is "
            f"{len(ids)} tokens long, which leaves no room for a completion.",
            param,
        )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """None -> whatever fits; a request that cannot fit is a 400 (as OpenAI and vLLM answer)."""
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the prompt or {param}.",
            param,
        )
    return requested


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size}).", "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}.", "logit_bias")
        out[tok] = float(bias)
    return out


def to_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    vocab_size: int,
    max_num_seqs: int,
    best_of: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Raises ValueError (-> 400 naming the field) for values SamplingParams refuses."""
    kwargs: dict[str, Any] = dict(
        n=req.n,
        best_of=best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        stop=req.stop or (),
        max_tokens=max_tokens,
        top_k=req.top_k if req.top_k is not None else 0,
        min_p=req.min_p if req.min_p is not None else 0.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    params = SamplingParams(**kwargs)
    if params.actual_best_of > max_num_seqs:
        # The scheduler admits a request's samples together: more than max_num_seqs would never fit
        # and would hold the head of the waiting queue forever.
        field = "best_of" if best_of is not None and best_of > req.n else "n"
        raise bad_request(f"{field} must be at most max_num_seqs ({max_num_seqs}), got {params.actual_best_of}.", field)
    return params
