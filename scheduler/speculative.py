"""Speculative decoding on the controller: the configuration, and the n-gram (prompt lookup) proposer.

vLLM's `speculative_config` names: `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M,
"prompt_lookup_min": m}`. Each step the scheduler asks `propose_ngram` for up to k tokens that continue a
decoding sequence, schedules [its last token + the proposals] as one row, and the target model verifies them
in that one forward (model_exec/spec_verify.py); the accepted run and one token of the target's own follow.

The proposer looks for the longest n-gram (M down to m tokens) that ends the sequence and occurred earlier in
its own prompt + output, and proposes the tokens that followed that occurrence. Decision: the most recent
occurrence wins (vLLM's V1 proposer takes the first): in a copy or an edit the latest match is the one
being copied; both are exact, only the acceptance rate can differ.

`{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`: a smaller model sharing the target's
vocabulary proposes. The scheduler cannot know its tokens, so it schedules k placeholder proposals
(`PLACEHOLDER_TOKEN`) like n-gram ones (the lookahead slots, the budget, the same limits) and rank 0's model
runner fills them with the draft's greedy tokens before the target verifies them (model_exec/draft_model.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model")
_KNOWN_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"})
# vLLM's defaults when neither lookup bound is given.
_DEFAULT_LOOKUP = 5
_NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's older spelling: the method named as the model


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int  # k: most tokens proposed per sequence per step
    prompt_lookup_max: int = 0  # ngram: longest n-gram looked up
    prompt_lookup_min: int = 0  # ngram: shortest n-gram looked up
    model: str | None = None  # draft_model: the draft's path (a folder or a GGUF file, as `model` takes)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}."
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}."
            )
        if self.method == "draft_model":
            if not self.model:
                raise ValueError('speculative_config: method "draft_model" needs "model", the draft\'s path.')
            if self.prompt_lookup_min or self.prompt_lookup_max:
                raise ValueError('speculative_config: prompt_lookup_min/max apply to method "ngram" only.')
        elif self.model is not None:
            raise ValueError('speculative_config: "model" names a draft model: method "draft_model" only.')
        elif not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict (the `--speculative-config` JSON); unknown keys and methods are refused by name."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}.")
        unknown = sorted(set(raw) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}.")
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config: model must be a path (a string), got {model!r}.")
        method = raw.get("method")
        if method is None and model is not None:  # vLLM's older spelling: the method named as the model, or a path
            method = "ngram" if model in _NGRAM_MODELS else "draft_model"
        if method is None:
            raise ValueError('speculative_config: "method" is required ("ngram" or "draft_model").')
        if method == "ngram" and model in _NGRAM_MODELS:
            model = None
        k = _int(raw, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required.")
        lo, hi = _int(raw, "prompt_lookup_min"), _int(raw, "prompt_lookup_max")
        if method == "draft_model":
            return cls(
                method=str(method),
                num_speculative_tokens=k,
                prompt_lookup_max=hi or 0,
                prompt_lookup_min=lo or 0,
                model=model,
            )
        lo = lo if lo is not None else hi if hi is not None else _DEFAULT_LOOKUP  # each bound defaults to the other
        hi = hi if hi is not None else lo
        return cls(
            method=str(method), num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo, model=model
        )


def _int(raw: Mapping[str, Any], name: str) -> int | None:
    value = raw.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"speculative_config: {name} must be an integer, got {value!r}.")
    return value


def propose_ngram(tokens: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to `limit` (<= k) tokens that followed the most recent earlier occurrence of the longest n-gram
    (prompt_lookup_max down to prompt_lookup_min tokens) ending `tokens`; [] when none occurs."""
    limit = min(limit, config.num_speculative_tokens)
    length = len(tokens)
    if limit < 1 or length < config.prompt_lookup_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Candidate starts: where the suffix's last token occurs earlier (its continuation exists: s + n < length).
    for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
        pattern = arr[length - n :]
        windows = sliding_window_view(arr[: length - 1], n)  # starts 0 .. length-1-n: never the suffix itself
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + limit].tolist()
    return []
