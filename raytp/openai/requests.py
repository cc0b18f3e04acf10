"""OpenAI request fields -> SamplingParams: defaults, JSON-string logit_bias keys, max_tokens, prompt
truncation, and the constraint a request puts on its output (`structured_outputs`).

Only the OpenAI-specific translation happens here. Values are validated once, by SamplingParams
(ranges) and the engine's request check (vocabulary, max_model_len, max_num_seqs); both raise
`RequestError` naming the field, which the HTTP layer answers with a 400.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from model_exec.generation_config import SAMPLING_FIELDS
from raytp.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from raytp.openai.structured import ResponseFormat
from request.errors import RequestError
from request.sampling_params import SamplingParams
from request.structured_outputs import StructuredOutputsParams

# guided_decoding_backend values raytp can honour: its one backend is llguidance ("guidance" in vLLM).
BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's older top-level constraint fields -> the StructuredOutputsParams kind each sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, str]:
    """(the requested completion length, the field it came from): max_completion_tokens wins, as in vLLM."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the last max_model_len)."""
    if keep is None:
        return ids
    if keep == 0 or keep > max_model_len:
        raise RequestError(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (max_model_len), got {keep}.",
            "truncate_prompt_tokens",
        )
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str, default: int | None = None
) -> int | None:
    """OpenAI's semantics: a request whose prompt plus max_tokens cannot fit is a 400 (as vLLM answers).
    Unrequested, the model's default (its generation_config's max_new_tokens) capped at what fits, as vLLM's
    get_max_tokens; with no default, None: "as many as fit", which the engine caps at max_model_len."""
    room = max_model_len - prompt_len
    if requested is None:
        return default if default is None or room <= 0 else min(default, room)
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


def _from_response_format(rf: ResponseFormat) -> dict[str, Any] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema.", "response_format")
        return {"json": rf.json_schema.schema_}
    if rf.structures is None or rf.triggers is None:
        raise RequestError("response_format of type structural_tag needs structures and triggers.", "response_format")
    structures = [t.model_dump(by_alias=True) for t in rf.structures]
    return {"structural_tag": {"structures": structures, "triggers": rf.triggers}}


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one source it used (two sources are a 400: which
    one wins would be a guess). Shape errors name the source field; so do the engine's compile errors."""
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in BACKENDS:
        raise RequestError(
            f"guided_decoding_backend must be one of {', '.join(BACKENDS)} (raytp's backend is llguidance), "
            f"got {req.guided_decoding_backend!r}.",
            "guided_decoding_backend",
        )
    sources: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None and (spec := _from_response_format(req.response_format)) is not None:
        sources.append(("response_format", spec))
    if req.structured_outputs is not None:
        spec = req.structured_outputs.model_dump(by_alias=True, exclude={"disable_fallback"})
        sources.append(("structured_outputs", spec))
    sources += [(name, {kind: getattr(req, name)}) for name, kind in GUIDED.items() if getattr(req, name) is not None]
    if len(sources) > 1:
        raise RequestError(
            f"Send at most one output constraint; this request has {' and '.join(n for n, _ in sources)}.",
            sources[1][0],
        )
    if req.guided_whitespace_pattern is not None:
        if not sources or not ({"json", "json_object"} & {k for k, v in sources[0][1].items() if v}):
            raise RequestError(
                "guided_whitespace_pattern applies to a JSON constraint only.", "guided_whitespace_pattern"
            )
        if sources[0][1].get("whitespace_pattern") is not None:
            raise RequestError("Send whitespace_pattern once, not also as guided_whitespace_pattern.", sources[0][0])
        sources[0][1]["whitespace_pattern"] = req.guided_whitespace_pattern
    if not sources:
        return None
    field, spec = sources[0]
    return StructuredOutputsParams(**spec, field=field)


# SamplingParams fields that the request translates (below); every other SamplingParams field the request
# declares under the same name is handed over as it is (SamplingParams normalises and checks it), so a new
# sampling parameter spelled alike on both sides needs no line here.
_TRANSLATED = frozenset({"logit_bias", "max_tokens", "logprobs", "prompt_logprobs", "structured_outputs"})
PASSED_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name in SamplingFields.model_fields and f.name not in _TRANSLATED
)


def to_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """`defaults`: the model's sampling defaults (`ServingContext.generation_defaults`), for the fields the
    request leaves unset. Raises RequestError (-> 400 naming the field) for values SamplingParams refuses."""
    defaults = defaults or {}
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise RequestError("best_of greater than n is not supported when streaming.", "best_of")
    kwargs: dict[str, Any] = {}
    for name in PASSED_FIELDS:
        value = getattr(req, name)
        if value is None and name in SAMPLING_FIELDS:
            value = defaults.get(name)  # unset (omitted or null): the model's default, else SamplingParams'
        if value is not None:  # None: SamplingParams' own default
            kwargs[name] = value
    return SamplingParams(
        **kwargs,
        logit_bias=_logit_bias(req.logit_bias),
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs(req),
    )
