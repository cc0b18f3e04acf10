"""SamplingParams: what a request asks of the sampler and of the stop checker.

Mirrors vLLM's `SamplingParams` field names and defaults so users can switch.
Validation happens in `__post_init__`: every value must be finite and in range, integers must
fit the engine's int64 tensors, and every failure is a `RequestError` naming the field (`param`),
which the HTTP layer answers with a 400 by type. Checks that need the model (vocabulary size,
max_model_len, max_num_seqs) live in `request.check`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from request.errors import RequestError
from request.structured_outputs import StructuredOutputsParams

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on |logit_bias| values
# The fields that hold token ids (of a dict: its keys); `request.check` holds each to the model's vocabulary.
TOKEN_ID_FIELDS: tuple[str, ...] = ("stop_token_ids", "logit_bias")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite_in(name: str, x: float, lo: float, hi: float, what: str) -> None:
    if not (isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi):
        raise RequestError(f"{name} must be {what}, got {x!r}.", name)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions returned
    best_of: int | None = None  # completions generated (the n best by cumulative logprob are returned)
    presence_penalty: float = 0.0  # OpenAI semantics: subtract once if the token already appeared in the output
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
    # With skip_special_tokens=False: False joins adjacent special tokens without the spaces some
    # decoders put between them (vLLM's meaning for fast tokenizers); True keeps the decoder's text.
    spaces_between_special_tokens: bool = True
    # A grammar the output must follow (JSON schema, regex, choice, ...): each step the sampler may pick only
    # tokens the sample's matcher allows, and the sample ends (stop) when the grammar is complete.
    structured_outputs: StructuredOutputsParams | None = None

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
        if not _is_int(self.n) or not 1 <= self.n <= _INT32_MAX:
            raise RequestError(f"n must be a positive integer, got {self.n!r}.", "n")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= _INT32_MAX):
            raise RequestError(
                f"best_of must be an integer greater than or equal to n, got n={self.n} and best_of={self.best_of!r}.",
                "best_of",
            )
        _finite_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _finite_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _finite_in("repetition_penalty", self.repetition_penalty, 1e-6, 1e6, "a finite number greater than zero")
        _finite_in("temperature", self.temperature, 0.0, 1e6, "a finite non-negative number")
        _finite_in("top_p", self.top_p, 1e-12, 1.0, "in (0, 1]")
        _finite_in("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT32_MAX:
            raise RequestError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}.", "top_k")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT32_MAX):
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}.", "max_tokens")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= _INT32_MAX:
            raise RequestError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
                "min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _INT32_MAX):
                raise RequestError(f"{name} must be a non-negative integer, got {value!r}.", name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must hold non-empty strings only.", "stop")
        if any(not _is_int(t) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers.", "stop_token_ids")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise RequestError(f"seed must be an integer in the int64 range, got {self.seed!r}.", "seed")
        for tok, bias in (self.logit_bias or {}).items():
            if not _is_int(tok) or not 0 <= tok <= _INT64_MAX:
                raise RequestError(f"logit_bias keys must be token ids, got {tok!r}.", "logit_bias")
            _finite_in("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, "a map to values in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}.",
                "structured_outputs",
            )
        if self.best_of is not None and self.best_of > 1 and self.temperature == 0.0:
            # Greedy samples would all be identical; vLLM refuses this too.
            raise RequestError("best_of must be 1 when temperature is 0 (greedy sampling).", "best_of")
        if self.n > 1 and self.temperature == 0.0:
            raise RequestError("n must be 1 when temperature is 0 (greedy sampling).", "n")

    @property
    def actual_best_of(self) -> int:
        """How many sequences the request generates."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)
