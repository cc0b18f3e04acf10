"""Speculative verification on rank 0 (model_exec/spec_verify.py): the emitted tokens follow the target's
distribution at every position, and each position's draw is the one the plain engine makes there.

The distribution check is the issue's: for k = 1..4 proposals, over 2,000 seeded samples, the histogram of
the token emitted at each position (given the proposals before it were accepted) matches the target's
probabilities there (chi-square, p > 0.01), and each proposal is accepted at the rate the target gives it.
The target's logits are a tiny random model's kind: fixed random rows, one per position.
"""

from __future__ import annotations

import pytest
import torch

from model_exec.sampler import Sampler, SamplingMetadata
from model_exec.spec_verify import RowToSample, accept_run, sample_rows
from request.sampling_params import SamplingParams
from scheduler.outputs import SeqSample

VOCAB = 24
SAMPLES = 2000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's test of `counts` against `probs`, tokens expected < 5 times pooled into one bin."""
    n = float(counts.sum())
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def row(seed: int, drafts: list[int], params: SamplingParams, output: list[int] | None = None) -> RowToSample:
    return RowToSample(
        params=params,
        seed=seed,
        sample_index=0,
        prompt_token_ids=[1, 2, 3],
        output_token_ids=output if output is not None else [4, 5],
        num_samples=1,
        drafts=drafts,
    )


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_emitted_tokens_follow_the_targets_distribution_at_every_position(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(k + 1, VOCAB, generator=gen) * 1.5
    probs = torch.softmax(logits, dim=-1)
    # Proposals the target finds likely (so later positions are reached often), but never certain.
    drafts = [int(probs[j].argmax()) for j in range(k)]
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()
    runs = [sample_rows(sampler, logits, [row(seed, drafts, params)], ())[0].token_ids for seed in range(SAMPLES)]
    for j in range(k + 1):
        reached = [r for r in runs if len(r) > j]  # every proposal before position j was accepted
        counts = torch.bincount(torch.tensor([r[j] for r in reached]), minlength=VOCAB)
        assert chi_square_p(counts, probs[j]) > 0.01, (j, len(reached))
        if j < k:  # accepted at the target's probability of the proposal: min(1, p/q) with a one-hot q
            rate = sum(1 for r in reached if r[j] == drafts[j]) / len(reached)
            sigma = (probs[j, drafts[j]] * (1 - probs[j, drafts[j]]) / len(reached)) ** 0.5
            assert abs(rate - float(probs[j, drafts[j]])) < 4 * float(sigma) + 1e-9, (j, rate)


def test_each_position_is_the_plain_engines_draw_there() -> None:
    """Position j of a verified row draws exactly what a plain row with the proposals before it appended to
    its output draws (same noise key, same penalty history): seeded outputs do not change."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, VOCAB, generator=gen)
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=2)
    sampler = Sampler()
    for seed in range(50):
        drafts = [3, 9, 11]
        verified = sample_rows(sampler, logits, [row(seed, drafts, params)], ())[0]
        for j, token in enumerate(verified.token_ids):
            plain = sample_rows(sampler, logits[j : j + 1], [row(seed, [], params, [4, 5, *drafts[:j]])], ())[0]
            assert plain.token_ids == [token]
            assert plain.logprobs == [verified.logprobs[j]] and plain.cumulative_logprob_deltas[0] == pytest.approx(
                verified.cumulative_logprob_deltas[j]
            )


def test_the_run_stops_at_the_first_mismatch_and_greedy_takes_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -5.0)
    for j, best in enumerate([7, 8, 2, 5]):
        logits[j, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler()
    assert sample_rows(sampler, logits, [row(0, [7, 8, 2], greedy)], ())[0].token_ids == [7, 8, 2, 5]  # all + bonus
    assert sample_rows(sampler, logits, [row(0, [7, 1, 2], greedy)], ())[0].token_ids == [7, 8]  # the correction
    assert sample_rows(sampler, logits, [row(0, [1, 8, 2], greedy)], ())[0].token_ids == [7]
    # rows with and without proposals in one batch: each answers its own
    mixed = sample_rows(sampler, torch.cat([logits, logits[:1]]), [row(0, [7, 8, 2], greedy), row(1, [], greedy)], ())
    assert [m.token_ids for m in mixed] == [[7, 8, 2, 5], [7]]


def test_accept_run_keeps_each_positions_logprob_delta() -> None:
    samples = [SeqSample([t], [-0.1 * (i + 1)]) for i, t in enumerate([4, 6, 1])]
    run = accept_run(samples, [4, 9])
    assert run.token_ids == [4, 6] and run.cumulative_logprob_deltas == [-0.1, -0.2] and run.logprobs is None


def test_the_sampler_alone_is_unchanged_for_rows_without_proposals() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.9, seed=5)
    rows = [row(s, [], params) for s in range(3)]
    meta = SamplingMetadata(
        params=[params] * 3,
        seeds=[0, 1, 2],
        sample_indices=[0] * 3,
        output_lens=[2] * 3,
        num_samples=[1] * 3,
        prompt_token_ids=[[1, 2, 3]] * 3,
        output_token_ids=[[4, 5]] * 3,
    )
    assert [s.token_ids for s in sample_rows(Sampler(), logits, rows, ())] == [
        s.token_ids for s in Sampler()(logits, meta)
    ]
