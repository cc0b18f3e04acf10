"""OpenAI request fields -> SamplingParams: defaults, JSON-string logit_bias keys, max_tokens.

Only the OpenAI-specific translation happens here. Values are validated once, by SamplingParams
(ranges) and the engine's request check (vocabulary, max_model_len, max_num_seqs); both raise
`RequestError` naming the field, which the HTTP layer answers with a 400.
"""

from __future__ import annotations

from typing import Any

from raytp.openai.protocol import SamplingFields
from scheduler.errors import RequestError
from scheduler.sampling_params import SamplingParams


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int | None:
    """OpenAI's semantics: a request whose prompt plus max_tokens cannot fit is a 400 (as vLLM answers);
    None means "as many as fit", which the engine caps at max_model_len."""
    room = max_model_len - prompt_len
    if requested is not None and 0 < room < requested:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            f"Please reduce the prompt or {param}.",
            param,
            "context_length_exceeded",
        )
    return requested  # room <= 0: the engine refuses the prompt itself (naming it)


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings: token ids arrive as "123"."""
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, bias in raw.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
    return out


def to_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    best_of: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Raises RequestError (-> 400 naming the field) for values SamplingParams refuses."""
    kwargs: dict[str, Any] = dict(
        n=req.n,
        best_of=best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
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
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    return SamplingParams(**kwargs)
