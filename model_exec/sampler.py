"""The batched sampler: one step's logits for the rows that sample -> one `SeqSample` per row.

Processing order (HF's warper order, vLLM's field semantics):
    grammar mask (structured outputs) -> logit_bias -> min_tokens mask -> penalties (repetition, frequency, presence)
    -> greedy rows: argmax
    -> other rows: temperature -> top-k -> top-p -> min-p -> draw
Reported logprobs (and `cumulative_logprob_deltas`) are log_softmax of the RAW logits, before any of
the above: vLLM V1's default, and what a Hugging Face reference reproduces.

Randomness is batch-independent: a row's draw is a function of its own logits, seed, sample index and
step (output length) only, never of its position in the batch or of its neighbours. Each draw is an
exponential race, argmax(probs / E) with E ~ Exp(1) per token of the row's support (tokens with nonzero
probability, in token-id order; equivalent to sampling from probs). The draw's 64-bit key is a
SplitMix64 mix of (seed, sample_index, step). Two noise sources, chosen per device (`Sampler(noise=...)`):
- "generator" (CPU): a `torch.Generator` reseeded with the key draws the support's uniforms; a Python
  loop over the draws, ~3x cheaper on the CPU than hashing every token (measured: 30-40 vs 90-130 ms CPU
  for 64 rows x 49k tokens, one thread).
- "counter" (CUDA): token j of the support gets element j of SplitMix64's stream under the key, int64
  tensor arithmetic over the whole [draws, V] grid: no Python loop over rows and no host sync. The same
  bits on any device (`race_over_support` computes them for the support only). Decision (issue 29):
  seeded outputs on CUDA differ from earlier versions (a CUDA generator reseeded per draw); on the CPU
  they are unchanged.

Every stage is skipped when no row needs it, so an all-greedy batch without penalties or bias is one
argmax (plus the log_softmax the logprob deltas need). Temperatures below 1e-5 count as greedy, as in
vLLM. On CPU, row-local work runs in chunks of rows to keep temporaries small; no result depends on the
chunking, because every reduction that decides a value runs within one row. Ties follow value
semantics everywhere: argmax
takes the first maximal index (as HF does), top-k keeps every token tied with the k-th largest, top-p
keeps every token tied with the one that reaches the mass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch

from request.sampling_params import SamplingParams
from scheduler.outputs import SeqSample, TokenLogprobs

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS); dividing by them would overflow fp32.
_GREEDY_TEMPERATURE = 1e-5
# Top-p first looks for its boundary among the top 64, then top 1024 tokens, and only sorts the whole
# row when those do not hold the mass: a full sort costs ~2 ms per 49k-token row on CPU.
_TOP_P_CANDIDATES = (64, 1024)
# On CPU, big temporaries cost more in fresh pages than in arithmetic: row-local work runs in chunks of
# about this many logits (4 MiB of fp32). A row's result never depends on its chunk.
_CPU_CHUNK_ELEMENTS = 1 << 20
_MASK64 = (1 << 64) - 1


_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# A uniform variate keeps the top 24 bits of a stream element: u = (bits + 0.5) / 2^24 is exact in fp32,
# lies in (0, 1), and E = -log(u) <= 17.4, so the likeliest token's score stays > 0 (see _draw).
_UNIFORM_BITS = 24


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, sample_index: int, step: int) -> int:
    """The 64-bit noise key of one draw; depends on these three values only (any Python ints).

    Note: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed; splitmix makes those depend
    on every input bit, so distinct draws share noise only by a 2^-32 accident.
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (sample_index & _MASK64))
    return _splitmix64(h ^ (step & _MASK64))


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> n).bitwise_and_((1 << (64 - n)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on int64 tensors (x is not modified): int64 add and multiply wrap modulo 2^64 on CPU and
    CUDA alike, so the bit patterns are those of the unsigned arithmetic. In place after the first add, so a
    [rows, V] grid costs two int64 temporaries at a time."""
    x = x + _signed(_GAMMA)
    x.bitwise_xor_(_shr(x, 30)).mul_(_signed(_MIX1))
    x.bitwise_xor_(_shr(x, 27)).mul_(_signed(_MIX2))
    return x.bitwise_xor_(_shr(x, 31))


def noise_keys(seeds: torch.Tensor, sample_indices: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`noise_seed` over int64 tensors (values already reduced to 64-bit patterns)."""
    h = _splitmix64_t(seeds)
    h = _splitmix64_t(h ^ sample_indices)
    return _splitmix64_t(h ^ steps)


def _stream_uniform(keys: torch.Tensor, counters: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Element `counters` of SplitMix64's stream under `keys` (broadcast together), as a uniform in (0, 1)."""
    bits = _shr(_splitmix64_t((counters * _signed(_GAMMA)).add_(keys)), 64 - _UNIFORM_BITS)
    return bits.to(dtype).add_(0.5).mul_(2.0**-_UNIFORM_BITS)


@dataclass
class SamplingMetadata:
    """What the sampler needs per logits row; built by the model runner each step (plain lists, no work)."""

    params: list[SamplingParams]  # the row's request params
    seeds: list[int]  # the sequence's seed (the request's, or engine-drawn when the user gave none)
    sample_indices: list[int]  # which of the request's best_of samples this sequence is
    output_lens: list[int]  # tokens generated so far: the RNG step and the min_tokens clock
    num_samples: list[int]  # tokens to draw: 1, or best_of at the fork after prefill (draw k uses index + k)
    prompt_token_ids: list[list[int]]  # for the repetition penalty
    output_token_ids: list[list[int]]  # for repetition, frequency and presence penalties
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids, masked while output_len < min_tokens
    # Structured outputs: rows under a grammar, and for each its packed allowed-token bitmask
    # (int32 [len(grammar_rows), ceil(V / 32)], bit t % 32 of word t // 32 = token t; scheduler.outputs).
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.params)


@dataclass
class _SampledRows:
    """Rows that draw from a distribution, with their knobs (0 / 1.0 / 0.0 mean off), in row order."""

    rows: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)

    def chunks(self, size: int) -> Iterator[_SampledRows]:
        if 0 < len(self.rows) <= size:
            yield self
            return
        for start in range(0, len(self.rows), size):
            part = slice(start, start + size)
            yield _SampledRows(
                self.rows[part],
                self.temperatures[part],
                self.top_ks[part],
                self.top_ps[part],
                self.min_ps[part],
            )


@dataclass
class _Plan:
    """One Python pass over the rows: which stage touches which row, as flat lists ready for tensors."""

    bias_rows: list[int] = field(default_factory=list)
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    masked_rows: list[int] = field(default_factory=list)  # min_tokens: (row, token) pairs set to -inf
    masked_tokens: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    greedy_rows: list[int] = field(default_factory=list)
    sampled: _SampledRows = field(default_factory=_SampledRows)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)


def _make_plan(meta: SamplingMetadata, vocab_size: int) -> _Plan:
    n = meta.num_rows
    lengths = (
        len(meta.seeds),
        len(meta.sample_indices),
        len(meta.output_lens),
        len(meta.num_samples),
        len(meta.prompt_token_ids),
        len(meta.output_token_ids),
    )
    if any(length != n for length in lengths):
        raise ValueError(f"SamplingMetadata lists must all have one entry per row ({n}), got {lengths}.")
    plan = _Plan()
    for i, sp in enumerate(meta.params):
        if sp.logit_bias:
            # Ids outside the vocabulary are the request validator's job; skipping them keeps the step alive.
            for tok, val in sp.logit_bias.items():
                if 0 <= int(tok) < vocab_size:
                    plan.bias_rows.append(i)
                    plan.bias_tokens.append(int(tok))
                    plan.bias_values.append(float(val))
        if meta.output_lens[i] < sp.min_tokens:
            # EOS is masked even with ignore_eos, as vLLM does (its all_stop_token_ids always hold EOS).
            for tok in sp.stop_token_ids + meta.eos_token_ids:
                if 0 <= tok < vocab_size:
                    plan.masked_rows.append(i)
                    plan.masked_tokens.append(tok)
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            plan.penalty_rows.append(i)
        if sp.temperature < _GREEDY_TEMPERATURE:
            plan.greedy_rows.append(i)
        else:
            plan.sampled.rows.append(i)
            plan.sampled.temperatures.append(sp.temperature)
            plan.sampled.top_ks.append(sp.top_k if sp.top_k < vocab_size else 0)
            plan.sampled.top_ps.append(sp.top_p)
            plan.sampled.min_ps.append(sp.min_p)
        if sp.logprobs is not None:
            plan.logprob_rows.append(i)
            plan.logprob_counts.append(min(sp.logprobs, vocab_size))
    return plan


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), V] float occurrence counts, one scatter_add over all tokens."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    lengths = [len(ids) for ids in token_lists]
    if sum(lengths) == 0:
        return counts
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), torch.tensor(lengths, device=device))
    counts.view(-1).scatter_add_(0, rows * vocab_size + ids, torch.ones(ids.shape[0], device=device))
    return counts


def _apply_penalties(x: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> None:
    """In place on x's rows: repetition (HF: divide positive, multiply negative logits of tokens seen in
    prompt + output), then frequency and presence (OpenAI: on output counts)."""
    vocab_size, device = x.shape[1], x.device
    rows_t = torch.tensor(rows, device=device)
    sub = x[rows_t]
    out_counts = _token_counts([meta.output_token_ids[i] for i in rows], vocab_size, device)
    rep = [meta.params[i].repetition_penalty for i in rows]
    freq = [meta.params[i].frequency_penalty for i in rows]
    pres = [meta.params[i].presence_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        seen = (out_counts > 0) | (_token_counts([meta.prompt_token_ids[i] for i in rows], vocab_size, device) > 0)
        rep_t = torch.tensor(rep, device=device).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep_t, sub * rep_t), sub)
    if any(f != 0.0 for f in freq):
        sub -= torch.tensor(freq, device=device).unsqueeze(1) * out_counts
    if any(p != 0.0 for p in pres):
        sub -= torch.tensor(pres, device=device).unsqueeze(1) * (out_counts > 0)
    x[rows_t] = sub


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from a packed int32 bitmask; tokens past the mask's width are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
    return bits[:, :vocab_size]


def _process_logits(logits: torch.Tensor, meta: SamplingMetadata, plan: _Plan) -> torch.Tensor:
    """Grammar masks, logit_bias, min_tokens, penalties. Never mutates logits; returns them as-is when no
    row needs any."""
    if not (meta.grammar_rows or plan.bias_rows or plan.masked_rows or plan.penalty_rows):
        return logits
    device = logits.device
    x = logits.clone()
    if meta.grammar_rows:
        assert meta.grammar_bitmask is not None
        rows_t = torch.tensor(meta.grammar_rows, device=device)
        allowed = allowed_tokens(meta.grammar_bitmask.to(device), x.shape[1])
        x[rows_t] = x[rows_t].masked_fill_(~allowed, -torch.inf)
    if plan.bias_rows:
        x.index_put_(
            (torch.tensor(plan.bias_rows, device=device), torch.tensor(plan.bias_tokens, device=device)),
            torch.tensor(plan.bias_values, dtype=x.dtype, device=device),
            accumulate=True,
        )
    if plan.masked_rows:
        x[torch.tensor(plan.masked_rows, device=device), torch.tensor(plan.masked_tokens, device=device)] = -torch.inf
    if plan.penalty_rows:
        _apply_penalties(x, meta, plan.penalty_rows)
    return x


def _select(x: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of x to work on: x itself when that is all of them, else a copy and the index to write it back."""
    if len(rows) == x.shape[0]:
        return x, None
    rows_t = torch.tensor(rows, device=x.device)
    return x[rows_t], rows_t


def _apply_top_k(x: torch.Tensor, top_ks: list[int]) -> None:
    """In place: -inf below each row's k-th largest logit (ties with it are kept)."""
    rows = [j for j, k in enumerate(top_ks) if k > 0]
    sub, rows_t = _select(x, rows)
    ks = torch.tensor([top_ks[j] for j in rows], device=x.device)
    kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    sub.masked_fill_(sub < kth, -torch.inf)
    if rows_t is not None:
        x[rows_t] = sub


def _apply_top_p(probs: torch.Tensor, top_ps: list[float]) -> None:
    """In place: zero every token less likely than the one at which the descending cumulative mass first
    reaches p. The boundary is searched among the top candidates first; a row's result does not depend on
    how many candidates were looked at (same prefix, same cumsum), hence not on the batch."""
    vocab_size = probs.shape[1]
    pending = [j for j, p in enumerate(top_ps) if p < 1.0]
    for limit in (*_TOP_P_CANDIDATES, vocab_size):
        if not pending:
            return
        sub, rows_t = _select(probs, pending)
        ps = torch.tensor([top_ps[j] for j in pending], dtype=probs.dtype, device=probs.device).unsqueeze(1)
        full = limit >= vocab_size
        vals = sub.sort(dim=-1, descending=True).values if full else sub.topk(limit, dim=-1).values
        cum = vals.cumsum(dim=-1)
        # Rounding can leave a full row's total just under p: its cutoff is then the last token (keep all).
        boundary = (cum < ps).sum(dim=-1, keepdim=True).clamp_max_(vals.shape[1] - 1)
        cutoff = vals.gather(1, boundary)
        if full:
            done = [True] * len(pending)
        else:
            done_t = cum[:, -1:] >= ps
            cutoff.masked_fill_(~done_t, 0.0)  # rows whose boundary lies further down are left for later
            done = done_t.squeeze(1).tolist()
        sub.masked_fill_(sub < cutoff, 0.0)
        if rows_t is not None:
            probs[rows_t] = sub
        pending = [j for j, d in zip(pending, done, strict=True) if not d]


def _sampling_probs(x: torch.Tensor, sampled: _SampledRows, owned: bool) -> torch.Tensor:
    """Unnormalised probabilities the sampled rows (x, one row each) draw from. owned: x may be consumed."""
    device = x.device
    temperatures = torch.tensor(sampled.temperatures, dtype=x.dtype, device=device).unsqueeze(1)
    x = x.div_(temperatures) if owned else x / temperatures
    if any(k > 0 for k in sampled.top_ks):
        _apply_top_k(x, sampled.top_ks)
    probs = torch.softmax(x, dim=-1)
    if any(p < 1.0 for p in sampled.top_ps):
        _apply_top_p(probs, sampled.top_ps)
    if any(m > 0.0 for m in sampled.min_ps):
        # The ratio to the most likely token is unchanged by renormalisation, so no softmax is needed again.
        min_ps = torch.tensor(sampled.min_ps, dtype=probs.dtype, device=device).unsqueeze(1)
        probs.masked_fill_(probs < min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _chunk_rows(x: torch.Tensor) -> int:
    """Rows per chunk of row-local work: all of them off CPU."""
    return max(1, _CPU_CHUNK_ELEMENTS // x.shape[1]) if x.device.type == "cpu" else x.shape[0]


def window_rows(
    part: torch.Tensor, rows: list[int], next_i: int, start: int, end: int
) -> tuple[torch.Tensor | None, int]:
    """The rows of `part` (logits rows start..end-1) that `rows[next_i:]` (sorted) names inside the window, and
    the index of the first name past it: how `_raw_logprobs` and model_exec/device_samples.py collect whole
    logprob rows chunk by chunk."""
    stop = next_i
    while stop < len(rows) and rows[stop] < end:
        stop += 1
    if stop == next_i:
        return None, next_i
    return part[torch.tensor(rows[next_i:stop], device=part.device) - start], stop


def _raw_logprobs(
    logits: torch.Tensor, offsets: list[int], draw_tokens: list[int], logprob_rows: list[int]
) -> tuple[list[float], torch.Tensor | None]:
    """log_softmax of the raw logits at every draw (row i owns draws offsets[i]:offsets[i + 1]), and the
    whole rows of `logprob_rows` (sorted). log_softmax reduces each row on its own, so the values do not
    depend on the batch; a plain sum or logsumexp over a long row may be split across threads when the
    batch is small, and differ in the last bit."""
    device, num_rows = logits.device, logits.shape[0]
    size = _chunk_rows(logits)
    deltas: list[float] = []
    lp_parts: list[torch.Tensor] = []
    lp_next = 0
    one_each = len(draw_tokens) == num_rows  # every row one draw (no fork this step): draw i is row i's
    for start in range(0, num_rows, size):
        end = min(start + size, num_rows)
        part = torch.log_softmax(logits[start:end], dim=-1)
        tokens_t = torch.tensor(draw_tokens[offsets[start] : offsets[end]], dtype=torch.long, device=device)
        if one_each:
            deltas.extend(part.gather(1, tokens_t.unsqueeze(1)).squeeze(1).tolist())
        else:
            counts = torch.tensor([offsets[i + 1] - offsets[i] for i in range(start, end)], device=device)
            rows_t = torch.repeat_interleave(torch.arange(end - start, device=device), counts)
            deltas.extend(part[rows_t, tokens_t].tolist())
        got, lp_next = window_rows(part, logprob_rows, lp_next, start, end)
        if got is not None:
            lp_parts.append(got)
    return deltas, torch.cat(lp_parts) if lp_parts else None


NOISE_SOURCES = ("generator", "counter")


class Sampler:
    """Stateless apart from a reusable generator per device; every draw's noise is a function of its key."""

    def __init__(self, noise: str | None = None) -> None:
        """noise: "generator" or "counter" (module docstring); None: generator on the CPU, counter elsewhere."""
        if noise is not None and noise not in NOISE_SOURCES:
            raise ValueError(f"noise must be one of {', '.join(NOISE_SOURCES)} or None; got {noise!r}.")
        self.noise = noise
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    def processed_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[B, V] the distribution each row samples from (one-hot on the argmax for greedy rows)."""
        plan = _make_plan(meta, logits.shape[1])
        x = _process_logits(logits, meta, plan)
        out = torch.zeros_like(logits)
        if plan.greedy_rows:
            rows_t = torch.tensor(plan.greedy_rows, device=logits.device)
            out[rows_t, x[rows_t].argmax(dim=-1)] = 1.0
        if plan.sampled.rows:
            rows_t = torch.tensor(plan.sampled.rows, device=logits.device)
            probs = _sampling_probs(x[rows_t], plan.sampled, owned=True)
            out[rows_t] = probs / probs.sum(dim=-1, keepdim=True)
        return out

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SeqSample]:
        num_rows, vocab_size = logits.shape
        if num_rows == 0:
            return []
        plan = _make_plan(meta, vocab_size)
        x = _process_logits(logits, meta, plan)

        tokens: list[list[int]] = [[] for _ in range(num_rows)]
        if plan.greedy_rows:
            g_x, _ = _select(x, plan.greedy_rows)
            num_samples = meta.num_samples
            for i, tok in zip(plan.greedy_rows, g_x.argmax(dim=-1).tolist(), strict=True):
                tokens[i] = [tok] * num_samples[i]
        for part in plan.sampled.chunks(_chunk_rows(x)):
            self._draw(x, x is not logits, meta, part, tokens)

        # Draws flattened in row order: row i owns draws offsets[i]:offsets[i + 1].
        offsets = list(accumulate((len(row_tokens) for row_tokens in tokens), initial=0))
        draw_tokens = list(chain.from_iterable(tokens))
        deltas, lp = _raw_logprobs(logits, offsets, draw_tokens, plan.logprob_rows)
        samples = [
            SeqSample(row_tokens, deltas[first:last])
            for row_tokens, first, last in zip(tokens, offsets[:-1], offsets[1:], strict=True)
        ]
        if lp is not None:
            _fill_logprobs(lp, plan, offsets, deltas, samples)
        return samples

    def _generator_race(self, probs: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
        keys = [
            noise_seed(meta.seeds[i], meta.sample_indices[i] + k, meta.output_lens[i])
            for i in rows
            for k in range(meta.num_samples[i])
        ]
        return _generator_race_impl(probs, keys, self._generator(probs.device))

    def _draw(
        self,
        x: torch.Tensor,
        x_owned: bool,
        meta: SamplingMetadata,
        sampled: _SampledRows,
        tokens: list[list[int]],
    ) -> None:
        """Exponential race for every draw of these rows of x, into tokens. x_owned: x may be consumed."""
        drawn = self.race(x, x_owned, meta, sampled).tolist()
        pos = 0
        for i in sampled.rows:
            count = meta.num_samples[i]
            tokens[i] = drawn[pos : pos + count]
            pos += count

    def race(self, x: torch.Tensor, x_owned: bool, meta: SamplingMetadata, sampled: _SampledRows) -> torch.Tensor:
        """The drawn tokens of these rows of x (int64 [draws], row order, on x's device): no host read on the
        counter road (model_exec/device_samples.py keeps them there). x_owned: x may be consumed."""
        device = x.device
        s_x, rows_t = _select(x, sampled.rows)
        probs = _sampling_probs(s_x, sampled, owned=x_owned or rows_t is not None)
        repeat = [meta.num_samples[i] for i in sampled.rows]
        if sum(repeat) != probs.shape[0]:
            draw_rows = torch.repeat_interleave(torch.arange(len(repeat)), torch.tensor(repeat))
            probs = probs.index_select(0, draw_rows.to(device))
        noise = self.noise or ("generator" if device.type == "cpu" else "counter")
        if noise == "counter":
            # Token t of a draw's support gets stream element j = its rank in the support: a function of the
            # row alone. E = -log(U) <= 17.4, so the likeliest token's score stays > 0 and wins over the zeros
            # outside the support. Both races give the same draws.
            keys = _keys_tensor(meta, sampled.rows, repeat).to(device)
            race = race_over_support if device.type == "cpu" else race_over_grid
            return race(probs, keys)
        return self._generator_race(probs, meta, sampled.rows)


def _generator_race_impl(probs: torch.Tensor, keys: list[int], gen: torch.Generator) -> torch.Tensor:
    """The exponential race of each row of probs (consumed), its uniforms drawn for the support only (in
    token-id order) from `gen` reseeded with the row's key."""
    support = probs > 0
    counts = torch.count_nonzero(support, dim=-1).tolist()
    kept = probs.masked_select(support)
    uniform = torch.empty_like(kept)
    start = 0
    for key, count in zip(keys, counts, strict=True):
        gen.manual_seed(key)
        uniform[start : start + count].uniform_(generator=gen)
        start += count
    # E = -log(U) ~ Exp(1), U floored so E <= 87: the likeliest token's score stays > 0 and wins over the
    # zeros of the tokens outside the support.
    exp_noise = uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
    return probs.masked_scatter_(support, kept.div_(exp_noise)).argmax(dim=-1)


def race_over_support(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race of each row of probs (consumed) under its key, with noise computed for the
    support only: a truncated row (top-k/p, min-p) pays for its support, not the vocabulary (the CPU road).
    The support's size is read on the host (masked_select)."""
    support = probs > 0
    counts = torch.count_nonzero(support, dim=-1)
    kept = probs.masked_select(support)
    draw_of = torch.repeat_interleave(torch.arange(probs.shape[0], device=probs.device), counts)
    first = torch.cumsum(counts, dim=0) - counts
    rank = torch.arange(kept.shape[0], device=probs.device) - first[draw_of]
    exp_noise = _stream_uniform(keys[draw_of], rank, kept.dtype).log_().neg_()
    return probs.masked_scatter_(support, kept.div_(exp_noise)).argmax(dim=-1)


def race_over_grid(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`race_over_support`'s draws (the same bits), with noise over the whole [rows, V] grid and no host
    sync (the CUDA road). A token outside the support has probability 0 and scores 0 whatever its noise."""
    rank = torch.cumsum(probs > 0, dim=-1).sub_(1)
    exp_noise = _stream_uniform(keys.unsqueeze(1), rank, probs.dtype).log_().neg_()
    return probs.div_(exp_noise).argmax(dim=-1)


def _keys_tensor(meta: SamplingMetadata, rows: list[int], repeat: list[int]) -> torch.Tensor:
    """int64 [draws]: the noise key of every draw of `rows` (draw k of row i uses sample index + k)."""
    seeds = torch.tensor([_signed(meta.seeds[i] & _MASK64) for i in rows], dtype=torch.long)
    indices = torch.tensor([_signed(meta.sample_indices[i] & _MASK64) for i in rows], dtype=torch.long)
    steps = torch.tensor([_signed(meta.output_lens[i] & _MASK64) for i in rows], dtype=torch.long)
    reps = torch.tensor(repeat)
    if int(reps.sum()) != len(rows):  # a fork draws best_of children: sample indices index + 0, 1, ...
        draw_row = torch.repeat_interleave(torch.arange(len(rows)), reps)
        first = torch.cumsum(reps, dim=0) - reps
        child = torch.arange(draw_row.shape[0]) - first[draw_row]
        seeds, indices, steps = seeds[draw_row], indices[draw_row] + child, steps[draw_row]
    return noise_keys(seeds, indices, steps)


def _fill_logprobs(
    lp: torch.Tensor, plan: _Plan, offsets: list[int], deltas: list[float], samples: list[SeqSample]
) -> None:
    """Top-n raw logprobs (lp: one row per logprob row) plus each sampled token, whose value is its delta."""
    draws = [d for i in plan.logprob_rows for d in range(offsets[i], offsets[i + 1])]
    tok_lp = torch.tensor([deltas[d] for d in draws], dtype=lp.dtype, device=lp.device)
    top_vals, top_ids, ranks = logprob_tensors(lp, plan, offsets, tok_lp)
    write_logprobs(top_vals.tolist(), top_ids.tolist(), ranks.tolist(), plan, offsets, deltas, samples)


def logprob_tensors(
    lp: torch.Tensor, plan: _Plan, offsets: list[int], tok_lp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top values [L, n], their ids [L, n], each draw's rank [draws of the logprob rows]) on lp's device.
    Rank = 1 + the number of tokens with a strictly higher logprob, so ties share a rank. tok_lp: each such
    draw's logprob (its delta)."""
    rows = plan.logprob_rows
    max_n = max(plan.logprob_counts)
    if max_n > 0:
        top_vals, top_ids = lp.topk(max_n, dim=-1)
    else:
        top_vals, top_ids = lp[:, :0], lp[:, :0].long()
    lp_rows_t = torch.tensor(
        [j for j, i in enumerate(rows) for _ in range(offsets[i], offsets[i + 1])], device=lp.device
    )
    ranks = (lp[lp_rows_t] > tok_lp.unsqueeze(1)).sum(dim=-1) + 1
    return top_vals, top_ids, ranks


def write_logprobs(
    top_vals: list[list[float]],
    top_ids: list[list[int]],
    ranks: list[int],
    plan: _Plan,
    offsets: list[int],
    deltas: list[float],
    samples: list[SeqSample],
) -> None:
    """Each logprob row's SeqSample.logprobs from `logprob_tensors`' values, read back to the host."""
    draws = [d for i in plan.logprob_rows for d in range(offsets[i], offsets[i + 1])]
    pos = 0
    for j, i in enumerate(plan.logprob_rows):
        n = plan.logprob_counts[j]
        top: TokenLogprobs = {}
        for k, (val, tok) in enumerate(zip(top_vals[j][:n], top_ids[j][:n], strict=True)):
            # Values come sorted, so the first of a run of ties carries the run's (shared) rank.
            top[tok] = (val, k + 1 if k == 0 or val < top_vals[j][k - 1] else top[top_ids[j][k - 1]][1])
        per_token: list[TokenLogprobs] = []
        for tok in samples[i].token_ids:
            entry = dict(top)
            entry.setdefault(tok, (deltas[draws[pos]], ranks[pos]))
            per_token.append(entry)
            pos += 1
        samples[i].logprobs = per_token
