"""What the engine hands the metrics recorder: plain typed records, no Ray, no torch.

Modelled on vLLM V1's vllm/v1/metrics/stats.py. The owner of each fact fills its record and
calls the recorder (`ray_metrics.EngineMetrics`):

- `SchedulerStats`: the controller, once per engine step, after `schedule()`. A snapshot of the
  queues and the KV pool (gauges) plus the prefix-cache lookups made *since the previous
  SchedulerStats* (counter deltas).
- `IterationStats`: whoever sees a step's tokens reach their requests (the output path), once per
  step. Everything in it is a delta for that step, so recording the same step twice would count it
  twice; recording nothing for an idle step is correct.
- `FinishedRequestStats`: one per request (not per sequence: an n=2 request is one record) that
  finished in that step, carried inside its step's IterationStats.

Times are seconds on one process's clock (`time.monotonic()` differences); token counts are ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]  # registry.FINISH_REASONS, vLLM's FinishReason strings


@dataclass(frozen=True)
class LoRAStats:
    """What raytp:lora_requests_info shows (vLLM's vllm:lora_requests_info)."""

    running_adapters: tuple[str, ...]  # names of the adapters of the running and swapped requests, sorted
    waiting_adapters: tuple[str, ...]  # names of the adapters of the waiting requests, sorted
    max_lora: int  # max_loras: most adapters in one step


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int  # requests in the `running` queue after this step's schedule()
    num_waiting_reqs: int  # requests in `waiting` (new, and preempted by recompute)
    num_swapped_reqs: int  # requests in `swapped` (preempted by swap, KV on the CPU pool)
    kv_cache_usage: float  # fraction of device KV blocks in use, 0.0 to 1.0 (BlockManager.usage)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since the last SchedulerStats
    prefix_cache_hits: int = 0  # of those, tokens whose KV was found cached
    lora: LoRAStats | None = None  # None: the engine serves no adapters (enable_lora off)

    def __post_init__(self) -> None:
        if min(self.num_running_reqs, self.num_waiting_reqs, self.num_swapped_reqs) < 0:
            raise ValueError(f"queue lengths cannot be negative: {self}")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage is a fraction in [0, 1], got {self.kv_cache_usage}")
        if not 0 <= self.prefix_cache_hits <= self.prefix_cache_queries:
            raise ValueError(f"prefix cache hits must lie in [0, queries]: {self}")


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: FinishReason  # of the request; for n > 1, of its last sequence to finish
    e2e_latency: float  # arrival at the engine -> the last token (or the abort)
    num_prompt_tokens: int
    num_generation_tokens: int  # over all of the request's sequences (n > 1 adds them up)
    max_tokens_param: int | None  # the request's max_tokens; None when the caller gave none
    n_param: int  # the request's n (number of sequences)
    queued_time: float  # arrival -> first scheduled (WAITING)
    prefill_time: float  # first scheduled -> first token (preemptions during prefill included)
    decode_time: float  # first token -> last token (preemptions during decode included)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0 or self.num_generation_tokens < 0 or self.n_param < 1:
            raise ValueError(f"token counts must be >= 0 and n >= 1: {self}")
        if min(self.e2e_latency, self.queued_time, self.prefill_time, self.decode_time) < 0:
            raise ValueError(f"durations cannot be negative: {self}")


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative decoding in one step (vLLM V1's SpecDecodingStats): deltas of the scheduler's counters."""

    num_drafts: int = 0  # rows that carried proposals
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of those, tokens the target accepted
    # Index i: drafts whose proposal at position i was accepted; length k (num_speculative_tokens).
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted_tokens <= self.num_draft_tokens or self.num_drafts < 0:
            raise ValueError(f"need drafts >= 0 and 0 <= accepted <= draft tokens: {self}")
        if sum(self.num_accepted_tokens_per_pos) != self.num_accepted_tokens:
            raise ValueError(f"accepted tokens per position must add up to the accepted tokens: {self}")


@dataclass
class IterationStats:
    # Whole prompts of the requests whose first token came this step: each prompt counts once,
    # as in vLLM, so the counter matches the prompt_tokens of the usage blocks users receive
    # (cached prefixes and recomputation after preemption are not counted again).
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # tokens sampled this step and kept, over all sequences
    num_scheduled_tokens: int = 0  # tokens this step's forward pass processed (prefill chunks + decodes)
    num_preempted_reqs: int = 0  # requests preempted (recompute or swap) by this step's schedule()
    time_to_first_tokens: list[float] = field(default_factory=list)  # per request whose first token came now
    # per request that received tokens this step (not its first): time since its previous ones (vLLM V1's ITL)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    step_time: float | None = None  # wall time of the whole engine step; None: not measured here
    spec_decoding: SpecDecodingStats | None = None  # None: the engine does not speculate


@dataclass(frozen=True)
class BatchProgress:
    rows_total: int  # rows in the input file (known once it is validated)
    rows_done: int  # rows answered so far, resumed ones (already in the journal) included
    rows_failed: int  # of rows_done, those whose answer is an error

    def __post_init__(self) -> None:
        if not 0 <= self.rows_failed <= self.rows_done <= self.rows_total:
            raise ValueError(f"need 0 <= rows_failed <= rows_done <= rows_total: {self}")
