"""SamplingParams: what a request asks of the sampler and of the stop checker.

Mirrors vLLM's `SamplingParams` field names and defaults so users can switch.
Validation happens in `__post_init__`; every error is a `ValueError` whose message
starts with the offending field's name, because the HTTP layer turns it into a 400
with `param` set to that field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions returned
    best_of: int | None = None  # completions generated (the n best by cumulative logprob are returned)
    presence_penalty: float = (
        0.0  # OpenAI semantics: subtract once if the token already appeared in the output
    )
    frequency_penalty: float = 0.0  # subtract per occurrence in the output
    repetition_penalty: float = 1.0  # HF/CTRL semantics over prompt + output tokens; 1.0 is off
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM users write it) disables top-k
    min_p: float = 0.0
    seed: int | None = None  # per-request RNG seed; results then do not depend on the rest of the batch
    stop: tuple[str, ...] = ()  # stop strings, matched on detokenized text and trimmed from the output
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (from the second token on)
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # free-form, carried untouched

    def __post_init__(self) -> None:
        # Normalise list inputs so the dataclass stays hashable-ish and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if self.best_of is not None and self.best_of > 1 and self.temperature == 0.0:
            # Greedy samples would all be identical; vLLM refuses this too.
            raise ValueError("best_of must be 1 when temperature is 0 (greedy sampling).")
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError("n must be 1 when temperature is 0 (greedy sampling).")

    @property
    def actual_best_of(self) -> int:
        """How many sequences the request generates."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
