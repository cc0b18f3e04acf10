"""The batched sampler against hand computations and an independent float64 reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_exec.sampler import (
    Sampler,
    SamplingMetadata,
    noise_keys,
    noise_seed,
    race_over_grid,
    race_over_support,
)
from request.sampling_params import SamplingParams
from scheduler.outputs import SeqSample

EOS = 0


@dataclass
class Row:
    """One logits row's sampling inputs; output_len defaults to len(output)."""

    params: SamplingParams
    seed: int = 0
    sample_index: int = 0
    num_samples: int = 1
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    output_len: int | None = None


def meta_of(rows: list[Row], eos: tuple[int, ...] = (EOS,)) -> SamplingMetadata:
    return SamplingMetadata(
        params=[r.params for r in rows],
        seeds=[r.seed for r in rows],
        sample_indices=[r.sample_index for r in rows],
        output_lens=[len(r.output) if r.output_len is None else r.output_len for r in rows],
        num_samples=[r.num_samples for r in rows],
        prompt_token_ids=[r.prompt for r in rows],
        output_token_ids=[r.output for r in rows],
        eos_token_ids=eos,
    )


def reference_probs(logits: list[float], row: Row, eos: tuple[int, ...] = (EOS,)) -> list[float]:
    """Float64, token-by-token, written from the definitions (not from the sampler's code)."""
    p = row.params
    x = list(logits)
    for tok, val in (p.logit_bias or {}).items():
        x[tok] += val
    output_len = len(row.output) if row.output_len is None else row.output_len
    if output_len < p.min_tokens:
        for tok in [*p.stop_token_ids, *eos]:
            x[tok] = -math.inf
    for tok in range(len(x)):
        if tok in row.prompt or tok in row.output:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        count = row.output.count(tok)
        x[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.temperature == 0:
        best = max(range(len(x)), key=lambda t: (x[t], -t))
        return [float(t == best) for t in range(len(x))]
    x = [v / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top = max(x)
    e = [math.exp(v - top) for v in x]
    probs = [v / sum(e) for v in e]
    if p.top_p < 1:
        # smallest set of most likely tokens holding >= top_p of the mass (plus ties with its last one)
        cum, cutoff = 0.0, 0.0
        for v in sorted(probs, reverse=True):
            cum += v
            cutoff = v
            if cum >= p.top_p:
                break
        probs = [v if v >= cutoff else 0.0 for v in probs]
    if p.min_p > 0:
        probs = [v if v >= p.min_p * max(probs) else 0.0 for v in probs]
    return [v / sum(probs) for v in probs]


def run(
    logits: torch.Tensor, rows: list[Row], eos: tuple[int, ...] = (EOS,), noise: str | None = None
) -> list[SeqSample]:
    return Sampler(noise)(logits, meta_of(rows, eos))


# Both noise sources (the CPU's generator, CUDA's counter-based hashing) run here on the CPU.
NOISE = pytest.mark.parametrize("noise", ["generator", "counter"])


# Small logits with clear gaps, so no top-k/top-p/min-p boundary is a rounding question.
SMALL = [0.3, 2.0, -1.0, 1.2, 0.9, -0.2]

CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.9, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
    SamplingParams(temperature=1.0, logit_bias={2: 2.5}, min_tokens=2, stop_token_ids=(3,)),
]
CONFIG_IDS = ["t1", "t0.5", "t2", "top_k", "top_p", "min_p", "k+p+min_p", "penalties", "bias+min_tokens"]


def config_row(params: SamplingParams, seed: int = 0) -> Row:
    return Row(params, seed=seed, prompt=[4, 1], output=[1, 5, 5])


# --- the distribution -------------------------------------------------------------------------------------


def test_processed_probs_match_reference_batched() -> None:
    rows = [config_row(p) for p in CONFIGS] + [config_row(SamplingParams(temperature=0.0))]
    logits = torch.tensor([SMALL] * len(rows))
    probs = Sampler().processed_probs(logits, meta_of(rows))
    for i, row in enumerate(rows):
        assert probs[i].tolist() == pytest.approx(reference_probs(SMALL, row), abs=1e-6), row.params


@pytest.mark.parametrize("params", CONFIGS, ids=CONFIG_IDS)
@NOISE
def test_sample_frequencies_match_processed_probs(params: SamplingParams, noise: str) -> None:
    draws = 4000
    rows = [config_row(params, seed=s) for s in range(draws)]
    logits = torch.tensor([SMALL] * draws)
    tokens = [s.token_ids[0] for s in run(logits, rows, noise=noise)]
    expected = reference_probs(SMALL, rows[0])
    counts = [tokens.count(t) for t in range(len(SMALL))]
    chi2 = 0.0
    for tok, (p, c) in enumerate(zip(expected, counts, strict=True)):
        if p == 0:
            assert c == 0, f"token {tok} has probability 0 but was drawn {c} times"
        else:
            chi2 += (c - draws * p) ** 2 / (draws * p)
    assert chi2 < 25.7, (counts, [round(p * draws) for p in expected])  # chi-square(5) at p = 1e-4


def test_top_p_over_large_vocab_matches_full_sort_and_is_batch_independent() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 5000
    peaked = torch.randn(vocab, generator=gen) * 4  # boundary among the first 64 candidates
    flat = torch.randn(vocab, generator=gen) * 0.2  # needs the whole row sorted
    medium = torch.randn(vocab, generator=gen) * 2.7  # boundary among the first 1024
    rows = [Row(SamplingParams(top_p=0.9, seed=7)) for _ in range(3)]
    logits = torch.stack([peaked, flat, medium])
    probs = Sampler().processed_probs(logits, meta_of(rows))
    kept = [(p > 0).sum().item() for p in probs]
    assert kept[0] < 64 < kept[2] < 1024 < kept[1]
    for i in range(3):
        ref = reference_probs(logits[i].double().tolist(), rows[i])
        assert torch.allclose(probs[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-6)
        alone = Sampler().processed_probs(logits[i : i + 1], meta_of(rows[i : i + 1]))
        assert torch.equal(alone[0], probs[i])


def test_top_k_keeps_ties_and_large_k_is_off() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    probs = Sampler().processed_probs(logits, meta_of([Row(SamplingParams(top_k=2))]))
    assert (probs[0] > 0).tolist() == [False, True, True, True, False]
    probs = Sampler().processed_probs(logits, meta_of([Row(SamplingParams(top_k=50))]))
    assert torch.allclose(probs[0], torch.softmax(logits[0], -1))


# --- greedy, bias, min_tokens, penalties -----------------------------------------------------------------


def test_greedy_is_argmax_and_takes_the_first_of_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=gen)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1
    before = logits.clone()
    samples = run(logits, [Row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert [s.token_ids for s in samples] == [[t] for t in logits.argmax(-1).tolist()]
    assert samples[3].token_ids == [10]
    assert torch.equal(logits, before)


def test_logit_bias_and_penalties_never_mutate_the_input() -> None:
    logits = torch.tensor([SMALL, SMALL])
    before = logits.clone()
    run(logits, [config_row(CONFIGS[-1]), config_row(CONFIGS[-2])])
    assert torch.equal(logits, before)


def test_logit_bias_applies_before_penalties() -> None:
    logits = torch.tensor([[1.0, 1.5, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, logit_bias={0: 1.0, 2: -0.5}, repetition_penalty=2.0)
    row = Row(params, output=[0, 2])
    # token 0: (1 + 1) / 2 = 1.0; token 2: (0 - 0.5) * 2 = -1.0
    expected = torch.softmax(torch.tensor([1.0, 1.5, -1.0, 0.0]), -1)
    assert torch.allclose(Sampler().processed_probs(logits, meta_of([row]))[0], expected, atol=1e-6)
    greedy = Row(SamplingParams(temperature=0.0, logit_bias={3: 2.0}))
    assert run(logits, [greedy])[0].token_ids == [3]


@pytest.mark.parametrize(
    ("params", "processed"),
    [
        # repetition 2.0 on tokens seen in prompt [0] or output [1, 1, 4]: divide positive, multiply negative
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]),
        # presence 0.5: once per distinct output token (1, 4)
        (SamplingParams(presence_penalty=0.5), [2.0, -1.5, 0.5, 3.0, -2.5, 1.0]),
        # frequency 0.5: per occurrence (1 twice, 4 once)
        (SamplingParams(frequency_penalty=0.5), [2.0, -2.0, 0.5, 3.0, -2.5, 1.0]),
        # all three, vLLM order: repetition, then frequency, then presence
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -3.25, 0.5, 3.0, -4.75, 1.0],
        ),
    ],
)
def test_penalties_against_hand_computation(params: SamplingParams, processed: list[float]) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = Row(params, prompt=[0], output=[1, 1, 4])
    probs = Sampler().processed_probs(logits, meta_of([row]))[0]
    assert torch.allclose(probs, torch.softmax(torch.tensor(processed), -1), atol=1e-6)
    # the same processed logits decide a greedy row
    greedy = Row(replace(params, temperature=0.0), prompt=[0], output=[1, 1, 4])
    assert run(logits, [greedy])[0].token_ids == [max(range(6), key=lambda t: processed[t])]


def test_repetition_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    row = Row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0])
    assert run(logits, [row])[0].token_ids == [1]  # 2.0 / 1.5 < 1.5


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.5, 0.2]])  # EOS (0) and the stop id (1) dominate
    params = SamplingParams(min_tokens=3, stop_token_ids=(1,))
    for output_len in range(3):
        rows = [Row(params, seed=s, output_len=output_len) for s in range(500)]
        tokens = {s.token_ids[0] for s in run(logits.expand(500, -1).contiguous(), rows)}
        assert tokens.isdisjoint({EOS, 1}) and tokens
        greedy = Row(replace(params, temperature=0.0), output_len=output_len)
        assert run(logits, [greedy])[0].token_ids == [3]
    assert run(logits, [Row(replace(params, temperature=0.0), output_len=3)])[0].token_ids == [EOS]
    # as in vLLM, ignore_eos does not lift the mask: min_tokens still means "no EOS before this many"
    ignoring = Row(replace(params, temperature=0.0, ignore_eos=True), output_len=0)
    assert run(logits, [ignoring])[0].token_ids == [3]
    probs = Sampler().processed_probs(logits, meta_of([Row(params, output_len=0)], eos=(EOS, 4)))[0]
    assert probs[[0, 1, 4]].tolist() == [0.0, 0.0, 0.0]


# --- seeded, batch-independent randomness ------------------------------------------------------------------


def mixed_rows() -> list[Row]:
    return [
        Row(SamplingParams(temperature=0.8, top_p=0.9, logprobs=3), seed=11, output=[5, 6]),
        Row(SamplingParams(temperature=0.0, logprobs=2), seed=12),
        Row(SamplingParams(temperature=1.0), seed=13, output_len=7),
        Row(SamplingParams(temperature=1.2, top_k=20), seed=14, sample_index=2),
        Row(SamplingParams(temperature=0.0, repetition_penalty=1.3), seed=15, prompt=[1, 2], output=[3]),
        Row(SamplingParams(temperature=0.9, min_p=0.05, presence_penalty=0.4), seed=16, output=[9, 9]),
        Row(SamplingParams(n=3, temperature=1.0, top_k=30, top_p=0.95, logprobs=1), seed=17, num_samples=3),
        Row(SamplingParams(temperature=0.7, logit_bias={4: 3.0}, min_tokens=4), seed=18, output_len=1),
    ]


def mixed_logits(rows: int, vocab: int = 64, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@NOISE
def test_a_seeded_sequence_draws_its_steps_independently(noise: str) -> None:
    """Across steps too, not only per step: a row that stops at EOS (probability q each step) outlives T steps
    with probability (1 - q)^T. A draw's noise that depended on the step only weakly (or not at all: then
    survival is 1 - q) would change how long sequences run (issue 41 compared raytp's lengths with vLLM's)."""
    params, steps, seeds, q = SamplingParams(temperature=0.7), 60, 2000, 0.015
    others = torch.tensor([0.5, 1.0, -0.3, 0.8, 0.2])
    # EOS's logit puts it at q after the temperature: exp(x0 / t) = q / (1 - q) * sum(exp(others / t))
    eos_logit = params.temperature * math.log(q / (1 - q) * float(torch.exp(others / params.temperature).sum()))
    logits_row = torch.cat([torch.tensor([eos_logit]), others])
    alive = list(range(seeds))
    sampler = Sampler(noise)
    for step in range(steps):
        rows = [Row(params, seed=s, output_len=step) for s in alive]
        drawn = sampler(logits_row.repeat(len(alive), 1), meta_of(rows))
        alive = [s for s, sample in zip(alive, drawn, strict=True) if sample.token_ids[0] != EOS]
    expected = (1 - q) ** steps
    assert abs(len(alive) / seeds - expected) < 4.5 * math.sqrt(expected * (1 - expected) / seeds), len(alive)


def test_seeded_results_repeat_across_runs_and_sampler_instances() -> None:
    rows, logits = mixed_rows(), mixed_logits(8)
    first = run(logits, rows)
    sampler = Sampler()
    assert sampler(logits, meta_of(rows)) == first
    assert sampler(logits, meta_of(rows)) == first


@NOISE
def test_seeded_results_do_not_depend_on_batch_order(noise: str) -> None:
    rows, logits = mixed_rows(), mixed_logits(8)
    base = run(logits, rows, noise=noise)
    for perm_seed in range(3):
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(perm_seed)).tolist()
        permuted = run(logits[perm], [rows[i] for i in perm], noise=noise)
        assert permuted == [base[i] for i in perm]


@NOISE
def test_seeded_results_do_not_depend_on_batch_composition(noise: str) -> None:
    rows, logits = mixed_rows(), mixed_logits(8)
    base = run(logits, rows, noise=noise)
    for i in range(8):
        assert run(logits[i : i + 1], [rows[i]], noise=noise) == [base[i]]
    others = mixed_logits(5, seed=1)
    extra = [Row(SamplingParams(temperature=0.0)), Row(SamplingParams(top_p=0.5), seed=99)] * 2 + [
        Row(SamplingParams(top_k=3, frequency_penalty=1.0), seed=3, output=[1, 2])
    ]
    batched = run(
        torch.cat([others[:2], logits[:3], others[2:], logits[3:]]),
        extra[:2] + rows[:3] + extra[2:] + rows[3:],
        noise=noise,
    )
    assert batched[2:5] + batched[8:] == base


def test_large_batch_spanning_cpu_chunks_matches_rows_alone() -> None:
    # 50 rows x 49152 tokens: the CPU path works in chunks of 21 rows, and a lone long row may have its
    # reductions split across threads; no row may notice, down to the last bit of its logprobs. Peaked
    # logits keep top-p off the full-sort path, which is slow on CPU.
    kinds = mixed_rows()
    rows = [replace(kinds[i % 8], seed=1000 + i) for i in range(50)]
    logits = mixed_logits(50, vocab=49_152, seed=5, scale=6.0)
    batched = run(logits, rows)
    reversed_batch = run(logits.flip(0), rows[::-1])
    assert reversed_batch[::-1] == batched
    for i in range(0, 50, 4):
        assert run(logits[i : i + 1], [rows[i]]) == [batched[i]]
        assert run(logits[i : i + 2], rows[i : i + 2]) == batched[i : i + 2]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.integers(0, 7),
    others=st.lists(st.integers(0, 7), max_size=6),
    position=st.integers(0, 6),
    logits_seed=st.integers(0, 1000),
)
def test_row_alone_equals_row_in_any_batch(target: int, others: list[int], position: int, logits_seed: int) -> None:
    rows, logits = mixed_rows(), mixed_logits(8, seed=logits_seed)
    alone = run(logits[target : target + 1], [rows[target]])[0]
    order = list(others)
    order.insert(min(position, len(order)), target)
    batched = run(logits[order], [rows[i] for i in order])
    assert batched[min(position, len(others))] == alone


@NOISE
def test_seed_sample_index_and_step_each_change_the_draw(noise: str) -> None:
    assert len({noise_seed(s, i, t) for s in (0, 1) for i in (0, 1) for t in (0, 1)}) == 8
    assert 0 <= noise_seed(-1, 0, 0) < 2**64 and 0 <= noise_seed(2**70, 3, 9) < 2**64  # any Python int
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure noise
    draw = lambda **kw: run(logits, [Row(SamplingParams(), **kw)], noise=noise)[0].token_ids[0]  # noqa: E731
    base = draw(seed=5)
    assert draw(seed=5) == base
    assert len({draw(seed=s) for s in range(20)}) > 15
    assert len({draw(seed=5, output_len=t) for t in range(20)}) > 15
    assert len({draw(seed=5, sample_index=k) for k in range(20)}) > 15


@NOISE
def test_num_samples_draws_the_children_streams(noise: str) -> None:
    logits = mixed_logits(1, vocab=200)
    params = SamplingParams(n=4, best_of=5, temperature=1.0, logprobs=2)
    fork = run(logits, [Row(params, seed=42, num_samples=5, output_len=0)], noise=noise)[0]
    assert len(fork.token_ids) == len(fork.cumulative_logprob_deltas) == len(fork.logprobs or []) == 5
    for k in range(5):
        child = run(logits, [Row(params, seed=42, sample_index=k, output_len=0)], noise=noise)[0]
        assert child.token_ids[0] == fork.token_ids[k]
        assert child.cumulative_logprob_deltas[0] == fork.cumulative_logprob_deltas[k]
        assert fork.logprobs is not None and child.logprobs == [fork.logprobs[k]]
    assert len(set(fork.token_ids)) > 1


# --- logprobs ---------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = mixed_logits(3, vocab=500, seed=4)
    params = SamplingParams(temperature=0.6, top_k=10, repetition_penalty=1.5, logprobs=5, logit_bias={7: 4.0})
    rows = [Row(params, seed=s, prompt=[1, 2, 3], output=[4, 4]) for s in range(3)]
    samples = run(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, sample in enumerate(samples):
        assert sample.logprobs is not None and len(sample.logprobs) == 1
        entry, tok = sample.logprobs[0], sample.token_ids[0]
        top5 = raw[i].topk(5).indices.tolist()
        assert set(entry) == set(top5) | {tok}
        for t, (lp, rank) in entry.items():
            assert abs(lp - raw[i, t].item()) < 1e-6
            assert rank == 1 + int((raw[i] > raw[i, t]).sum())
        assert [entry[t][1] for t in top5] == [1, 2, 3, 4, 5]
        assert sample.cumulative_logprob_deltas == [entry[tok][0]]


def test_logprobs_zero_gives_only_the_sampled_token_and_ties_share_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    sample = run(logits, [Row(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert sample.logprobs is not None and list(sample.logprobs[0]) == [1]
    assert sample.logprobs[0][1][1] == 1
    sample = run(logits, [Row(SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 10.0}))])[0]
    entry = sample.logprobs[0] if sample.logprobs else {}
    assert sample.token_ids == [4]
    assert {t: r for t, (_, r) in entry.items()} == {1: 1, 2: 1, 3: 3, 4: 5}


def test_deltas_are_raw_logprobs_and_logprobs_absent_unless_asked() -> None:
    logits = mixed_logits(8)
    samples = run(logits, mixed_rows())
    raw = torch.log_softmax(logits, -1)
    for i, (row, sample) in enumerate(zip(mixed_rows(), samples, strict=True)):
        assert len(sample.token_ids) == row.num_samples
        for tok, delta in zip(sample.token_ids, sample.cumulative_logprob_deltas, strict=True):
            assert abs(delta - raw[i, tok].item()) < 1e-6
        assert (sample.logprobs is None) == (row.params.logprobs is None)


def test_empty_batch_and_bad_metadata() -> None:
    assert Sampler()(torch.zeros(0, 10), meta_of([])) == []
    meta = meta_of([Row(SamplingParams())])
    meta.seeds.append(1)
    with pytest.raises(ValueError, match="one entry per row"):
        Sampler()(torch.zeros(1, 10), meta)


# --- structured outputs: the grammar bitmask -----------------------------------------------------------


def pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """The packed int32 bitmask (scheduler.outputs.SchedulerOutput.grammar_bitmask) of allowed token lists."""
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, toks in enumerate(allowed):
        for t in toks:
            mask[r, t // 32] |= 1 << (t % 32)
    return ((mask + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # as int32 bits (bit 31 is the sign)


def test_allowed_tokens_unpacks_every_bit_including_the_sign_bit() -> None:
    from model_exec.sampler import allowed_tokens

    vocab = 70
    rows = [[0, 31, 32, 63, 69], [5]]
    got = allowed_tokens(pack(rows, vocab), vocab)
    assert got.shape == (2, vocab)
    assert [torch.nonzero(r).flatten().tolist() for r in got] == rows


def test_grammar_mask_restricts_greedy_and_sampled_rows_only_where_given() -> None:
    vocab = 64
    logits = mixed_logits(3, vocab, seed=5)
    rows = [Row(SamplingParams(temperature=0.0)), Row(SamplingParams(temperature=1.0), seed=3), Row(SamplingParams())]
    allowed = [[7, 9], [1, 2, 3]]
    meta = meta_of(rows)
    meta.grammar_rows = [0, 1]
    meta.grammar_bitmask = pack(allowed, vocab)
    free = Sampler()(logits, meta_of(rows))
    for _ in range(20):
        rows[1].seed += 1
        rows[2].seed += 1
        meta.seeds = [r.seed for r in rows]
        out = Sampler()(logits, meta)
        assert out[0].token_ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())  # greedy among allowed
        assert out[1].token_ids[0] in allowed[1]
    # An unconstrained row beside constrained ones draws what it draws alone (same seed, same token).
    meta.seeds = [0, 3, 0]
    assert Sampler()(logits, meta)[2].token_ids == free[2].token_ids
    # The reported logprobs stay those of the raw logits (vLLM's default), mask or not.
    assert out[0].cumulative_logprob_deltas[0] == pytest.approx(
        torch.log_softmax(logits[0], -1)[out[0].token_ids[0]].item()
    )


def _int64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def test_tensor_noise_keys_are_the_python_keys_bit_for_bit() -> None:
    # int64 add/multiply wrap modulo 2^64: the tensor hash must equal the unsigned Python one.
    gen = torch.Generator().manual_seed(0)
    triples = [tuple(int(v) for v in torch.randint(-(2**62), 2**62, (3,), generator=gen)) for _ in range(300)]
    triples += [(2**64 - 1, 2**63, 7), (-1, 0, 0), (0, 0, 0)]
    cols = [torch.tensor([_int64(t[i]) for t in triples]) for i in range(3)]
    assert noise_keys(*cols).tolist() == [_int64(noise_seed(*t)) for t in triples]


def test_grid_race_draws_what_the_support_race_draws() -> None:
    # The CUDA road races over the whole grid, the CPU road over the support: same noise, same draws.
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 500, generator=gen)
    probs[probs < 0.7] = 0.0  # truncated rows (top-k/p, min-p) of different supports
    probs[5] = 0.0
    probs[5, 123] = 1.0  # a one-token support
    keys = torch.randint(-(2**62), 2**62, (64,), generator=gen)
    support_draws = race_over_support(probs.clone(), keys)
    assert torch.equal(race_over_grid(probs.clone(), keys), support_draws)
    assert support_draws[5] == 123
    assert bool((probs.gather(1, support_draws[:, None]) > 0).all())


def test_counter_noise_is_not_the_generator_noise_and_unknown_sources_are_refused() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure noise
    rows = [Row(SamplingParams(), seed=s) for s in range(20)]
    generator = [run(logits, [r], noise="generator")[0].token_ids[0] for r in rows]
    counter = [run(logits, [r], noise="counter")[0].token_ids[0] for r in rows]
    assert generator != counter
    assert run(logits, rows[:1]) == run(logits, rows[:1], noise="generator")  # the CPU's default
    with pytest.raises(ValueError, match="noise must be one of"):
        Sampler("philox")
