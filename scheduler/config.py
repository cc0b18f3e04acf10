"""Scheduler configuration (frozen; validated once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled: a whole prompt must fit one step."
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be auto, recompute or swap, got {self.preemption_mode!r}.")
