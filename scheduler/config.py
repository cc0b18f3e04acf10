"""Scheduler configuration (frozen; validated once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from scheduler.speculative import SpeculativeConfig

PreemptionMode = Literal["auto", "recompute", "swap"]
PREEMPTION_MODES: tuple[str, ...] = ("auto", "recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int  # longest prompt + output a sequence may reach
    max_num_seqs: int = 256  # sequences (batch rows) per step
    max_num_batched_tokens: int = 2048  # tokens (decodes + prefill chunks) per step
    enable_chunked_prefill: bool = True  # split prompts that do not fit the step's token budget
    # auto: swap a request with several live sequences (or a long single one when swap space exists),
    # recompute otherwise. recompute/swap force one mode (tests use them to exercise both paths).
    preemption_mode: PreemptionMode = "auto"
    # Most distinct LoRA adapters among the requests running or swapped out (so in any one step's batch);
    # requests without an adapter never count. Only requests with an adapter (enable_lora) meet the limit.
    max_loras: int = 1
    # Speculative decoding (scheduler/speculative.py): decoding rows carry up to k proposed tokens; None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        check_scheduler_fields(self)


class SchedulerFields(Protocol):
    """The scheduler's fields as a config holds them: SchedulerConfig, or the engine's config, where the two
    lengths are None until the model decides them."""

    @property
    def max_model_len(self) -> int | None: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int | None: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def preemption_mode(self) -> str: ...
    @property
    def max_loras(self) -> int: ...


def check_scheduler_fields(config: SchedulerFields) -> None:
    """The one set of rules for the scheduler's fields (ValueError naming the field). The engine's config runs
    it too, when the user's config is built, with None for the two lengths it decides later (from the model)."""
    max_model_len, max_num_batched_tokens = config.max_model_len, config.max_num_batched_tokens
    max_num_seqs, max_loras, preemption_mode = config.max_num_seqs, config.max_loras, config.preemption_mode
    enable_chunked_prefill = config.enable_chunked_prefill
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}.")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}.")
    if (
        not enable_chunked_prefill
        and max_model_len is not None
        and max_num_batched_tokens is not None
        and max_num_batched_tokens < max_model_len
    ):
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
            f"({max_model_len}) when chunked prefill is disabled: a whole prompt must fit one step."
        )
    if max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {max_loras}.")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be auto, recompute or swap, got {preemption_mode!r}.")
