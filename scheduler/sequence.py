"""Requests and their sequences, with the statuses of DESIGN.md.

A request (`SequenceGroup`) starts with one sequence. If it asks for several samples
(`best_of` > 1) it forks into that many sequences once its prompt has been computed:
the children share the prompt's KV blocks and copy-on-write the partial last one.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from request.lora import NO_LORA
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from scheduler.constraint import TokenConstraint
from scheduler.outputs import TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the caller aborted, or a worker failed
    FINISHED_IGNORED = enum.auto()  # the prompt can never fit (max_model_len or the KV pool)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM finish_reason string."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH_CAPPED,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_IGNORED,
    }
)
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass(eq=False)  # identity semantics: queues test membership, and two requests are never "equal"
class Sequence:
    """One generated continuation of a request's prompt."""

    seq_id: int
    prompt_token_ids: list[int]  # shared with the group and the siblings; never mutated
    seed: int
    sample_index: int  # which of the request's best_of samples (0 for the first)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (device, or CPU while swapped)
    cumulative_logprob: float = 0.0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # The sample's grammar matcher (structured outputs), advanced on every appended token; None: free text.
    constraint: TokenConstraint | None = None
    # What the workers hold of this sequence, so the scheduler sends them deltas (nothing to do with what
    # users were sent: that is the output processor's). Reset to 0 / [] when the workers must forget it.
    num_tokens_on_workers: int = 0
    block_table_on_workers: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> list[int]:
        """token_ids[start:] without building the whole list (start is usually near the end)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    # These two run for every running sequence several times a step: written out, not through the properties.
    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    def forget_worker_state(self) -> None:
        """The workers dropped this sequence (preempted / swapped): it travels in full next time."""
        self.num_tokens_on_workers = 0
        self.block_table_on_workers = []


@dataclass(eq=False)
class SequenceGroup:
    """One request: a prompt, its sampling params, and its live sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    forked: bool = False  # best_of children created (happens once, right after the prompt is computed)
    # prompt_logprobs[j] scores prompt token j; entry 0 is None (nothing precedes the first token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why the server could not finish it (FINISHED_IGNORED, or a worker failure)
    num_cached_tokens: int = 0  # leading prompt tokens found in the prefix cache at first admission
    lora_id: int = NO_LORA  # the adapter every sequence of the request runs with (LoRARequest.lora_int_id)
    # Root of its sequences' prefix-cache key chains: kv.prefix_cache.salt_of((lora_id, load generation));
    # None for the base model, whose keys stay unsalted.
    cache_salt: bytes | None = None
    # Later requests with an adapter admitted while this one waited for a free adapter slot (max_loras);
    # bounded by the scheduler so it cannot be passed forever.
    num_lora_bypasses: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # A pooling request (runner="pooling"): one forward over the whole prompt, then `pooled` holds its result
    # (float32 values, as ModelRunnerOutput.pooled) and the request finishes; `sampling_params` stays unused.
    pooling_params: PoolingParams | None = None
    pooled: Any = None

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def wants_fork(self) -> bool:
        return not self.forked and self.sampling_params.actual_best_of > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are collected while the first computation of the prompt runs."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids)
        )
