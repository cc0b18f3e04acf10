"""What crosses the controller <-> worker boundary each step.

The controller sends a `SchedulerOutput` to every tensor-parallel rank; rank 0 answers
with a `ModelRunnerOutput`. Workers keep per-sequence state between steps, so a
sequence travels in full (`NewSeqData`) only when it (re)enters the running batch
and as a delta (`CachedSeqData`) afterwards: per-step traffic grows with the number
of changes, not with the total context. Plain Python values and numpy arrays only (no tensors), so
the same objects pickle cheaply through Ray and are testable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams

# The asynchronous step (cluster/async_step.py) schedules a step before the previous step's samples are known:
# each sequence that step samples carries this id as its newest token until the sample arrives. Workers
# replace it with the token they sampled themselves for that sequence (ModelRunner keeps it), so a
# placeholder is only ever the last of a CachedSeqData's new_token_ids, and never in a NewSeqData.
PLACEHOLDER_TOKEN = -1

# token id -> (logprob, rank); rank 1 is the most likely token. The sampled token is always present.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class NewSeqData:
    """A sequence the workers have not seen yet, or must forget and re-learn (resumed after preemption)."""

    seq_id: int  # unique for the engine's lifetime; workers key their state by it
    token_ids: list[int]  # every known token: prompt + already generated output
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (for penalties, prompt logprobs)
    block_ids: list[int]  # the full block table at this step
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits, swap-in)
    num_scheduled_tokens: int  # new tokens to run this step: token_ids[num_computed : num_computed + this]
    sampling_params: SamplingParams  # the request's params (rank 0 samples with them)
    seed: int  # the sequence's RNG seed (request seed or engine-drawn), combined with the step for noise
    sample_index: int  # which of the request's best_of samples this sequence is (seeds differ per sample)
    lora_id: int = 0  # the request's LoRARequest.lora_int_id (request/lora.py); 0 (NO_LORA): the base model
    # a pooling request (runner="pooling"): rank 0 pools the prompt's hidden states instead of sampling
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)  # one per running row per step
class CachedSeqData:
    """A sequence the workers already hold; only what changed since the last step."""

    seq_id: int
    new_token_ids: list[int]  # tokens appended since the workers last saw the sequence (sampled by rank 0)
    num_kept_blocks: int  # workers keep block_table[:num_kept_blocks] (a copy-on-write replaces a tail entry)
    new_block_ids: list[int]  # then append these (blocks added or replaced since the last step)
    num_computed_tokens: int  # tokens whose KV is in the cache before this step
    num_scheduled_tokens: int  # new tokens to run this step


@dataclass
class SchedulerOutput:
    """One step's work for every rank. Rows run in the order: cached decodes, then the rest."""

    new_seqs: list[NewSeqData] = field(default_factory=list)  # seqs entering the batch (full data)
    cached_seqs: list[CachedSeqData] = field(default_factory=list)  # seqs the workers already know (deltas)
    finished_seq_ids: list[int] = field(default_factory=list)  # seqs to forget (finished, aborted, preempted)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block), first
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block), first
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write, before forward
    # seqs whose scheduled tokens reach the end of their known tokens: rank 0 samples `num_samples` tokens for each
    num_samples: dict[int, int] = field(default_factory=dict)  # seq_id -> samples to draw (best_of at the fork)
    # seqs whose prompt logprobs are wanted for the positions run this step
    prompt_logprobs_seq_ids: list[int] = field(default_factory=list)
    # Structured outputs: the sampling seqs under a grammar (filled by the scheduler), and row i of
    # `grammar_bitmask` (filled by the controller after scheduling) packs the tokens seq i may sample:
    # bit t % 32 of word t // 32 set = token t allowed. Rank 0 masks the logits with it before sampling.
    structured_seq_ids: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None  # int32 [len(structured_seq_ids), ceil(vocab / 32)]
    # Speculative decoding: seq_id -> the tokens proposed after its last token. Such a row runs
    # [last token + proposals] (its num_scheduled_tokens counts them); rank 0 verifies them and answers the
    # accepted run plus one token of its own as the seq's SeqSample.token_ids (model_exec/spec_verify.py).
    # The proposals never enter the workers' token state: accepted ones come back as the next step's tokens.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.cached_seqs
        )

    @property
    def is_empty(self) -> bool:
        return not (self.new_seqs or self.cached_seqs or self.blocks_to_swap_out or self.finished_seq_ids)


@dataclass(slots=True)  # one per sampled row per step: slots make it cheaper to build and to pickle
class SeqSample:
    """What rank 0 produced for one sequence in one step."""

    # sampled tokens, len == num_samples asked for this seq; a speculative row: its accepted proposals + 1
    token_ids: list[int]
    cumulative_logprob_deltas: list[float]  # raw-model logprob of each sampled token (ranks best_of samples)
    logprobs: list[TokenLogprobs] | None = None  # per sampled token, when SamplingParams.logprobs is set


@dataclass
class ModelRunnerOutput:
    """Rank 0's answer to a SchedulerOutput."""

    samples: dict[int, SeqSample] = field(default_factory=dict)  # seq_id -> sample, for every seq in num_samples
    # seq_id -> logprobs for the prompt positions computed this step, in order. Position p's entry scores
    # prompt token p given tokens < p; the very first prompt token has no entry (vLLM returns None for it).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # seq_id -> the pooled result of a pooling request whose whole prompt ran this step: an embedding, or a
    # cross-encoder's scores (float32 [num_labels]); the scheduler finishes the sequence on it
    pooled: dict[int, np.ndarray] = field(default_factory=dict)
