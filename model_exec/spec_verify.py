"""Speculative decoding on rank 0: verify a row's proposals with the target model's own sampler.

A row that carries proposals d_1..d_k ran [last token, d_1, ..., d_k] in one forward, so it has k + 1
logits rows: row j is the target's distribution for the token after d_j (after the last token for j = 0).
Each logits row is sampled as its own "virtual" sampler row, exactly as the non-speculative engine would
sample that position: the output so far extended by d_1..d_j (penalties, min_tokens) and the step
`len(output) + j` (the noise key, scheduler-independent by the sampler's design). The emitted run is
t_0, t_1, ... up to the first j where t_j != d_{j+1} (or all k + 1 when every proposal matches).

Why this is exact: position j's token is a function of that position's logits and noise alone, and the
logits at j are the target's given the accepted prefix, so the emitted tokens are the ones the engine
would emit without speculation, token for token, seeded or greedy. In distribution it is the standard
rejection rule for a one-hot proposal (n-gram): d is accepted with probability p(d) = min(1, p(d)/q(d)),
and a rejected position's token is drawn from p restricted to tokens != d, i.e. norm(max(0, p - q)).
Logprobs of emitted tokens are the target's (the sampler reports raw-logit logprobs per virtual row).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model_exec.sampler import Sampler, SamplingMetadata
from request.sampling_params import SamplingParams
from scheduler.outputs import SeqSample, TokenLogprobs


@dataclass
class RowToSample:
    """What rank 0 samples one row with (the model runner's per-sequence state)."""

    params: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_samples: int  # 1, or best_of at the fork (never with proposals)
    drafts: list[int]  # proposals this row verifies ([]: a plain row, one logits row)
    grammar_mask: np.ndarray | None = None  # int32 packed allowed tokens (structured outputs; never with proposals)


def sample_rows(
    sampler: Sampler, logits: torch.Tensor, rows: list[RowToSample], eos_token_ids: tuple[int, ...]
) -> list[SeqSample]:
    """One SeqSample per row. `logits` holds len(drafts) + 1 rows per row, in order; each is sampled as the
    position it scores (the virtual rows above), and a row with proposals answers its accepted run."""
    virtual = [(r, j) for r in rows for j in range(len(r.drafts) + 1)]
    meta = SamplingMetadata(
        params=[r.params for r, _ in virtual],
        seeds=[r.seed for r, _ in virtual],
        sample_indices=[r.sample_index for r, _ in virtual],
        output_lens=[len(r.output_token_ids) + j for r, j in virtual],
        num_samples=[r.num_samples for r, _ in virtual],
        prompt_token_ids=[r.prompt_token_ids for r, _ in virtual],
        output_token_ids=[r.output_token_ids + r.drafts[:j] if j else r.output_token_ids for r, j in virtual],
        eos_token_ids=eos_token_ids,
    )
    masked = [v for v, (r, _) in enumerate(virtual) if r.grammar_mask is not None]
    if masked:
        assert all(not virtual[v][0].drafts for v in masked), "rows under a grammar never carry proposals"
        meta.grammar_rows = masked
        meta.grammar_bitmask = torch.from_numpy(
            np.stack([m for v in masked if (m := virtual[v][0].grammar_mask) is not None])
        )
    drawn = sampler(logits, meta)
    if len(virtual) == len(rows):
        return drawn
    answers, first = [], 0
    for r in rows:
        span = len(r.drafts) + 1
        answers.append(accept_run(drawn[first : first + span], r.drafts) if r.drafts else drawn[first])
        first += span
    return answers


def accept_run(samples: list[SeqSample], drafts: list[int]) -> SeqSample:
    """Fold the k + 1 virtual rows' samples (one token each) of a row with proposals `drafts` into the
    row's answer: the accepted proposals and the target's token after them."""
    assert len(samples) == len(drafts) + 1, (len(samples), len(drafts))
    tokens: list[int] = []
    deltas: list[float] = []
    logprobs: list[TokenLogprobs] = []
    for j, sample in enumerate(samples):
        token = sample.token_ids[0]
        tokens.append(token)
        deltas.append(sample.cumulative_logprob_deltas[0])
        if sample.logprobs is not None:
            logprobs.append(sample.logprobs[0])
        if j == len(drafts) or token != drafts[j]:
            break
    return SeqSample(token_ids=tokens, cumulative_logprob_deltas=deltas, logprobs=logprobs or None)
