"""The sampler's draws kept on the device: the launch half of the asynchronous step (model_exec/step_launch.py).

`sample_on_device` runs `Sampler.__call__`'s stages in the same order on the same tensors, but stops before
any `.tolist()`: it leaves the drawn tokens, their raw logprobs and the logprob rows' top-n on the device, where
the next step's input ids read the tokens. `DeviceSamples.to_seq_samples` turns those tensors, once read back to
the host, into the very SeqSamples `Sampler.__call__` returns (same stage order, same values: tests hold them
equal). One draw per row only: a fork (`best_of`) samples through `Sampler.__call__`.

Host reads that remain inside the launch, each a device sync: top-p's candidate rounds read one flag per row
(`_apply_top_p`), and the CPU's generator race reads the support sizes; greedy rows, top-k, min-p, penalties,
bias, min_tokens and the counter race read nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_exec.sampler import (
    Sampler,
    SamplingMetadata,
    _chunk_rows,
    _make_plan,
    _Plan,
    _process_logits,
    _select,
    logprob_tensors,
    window_rows,
    write_logprobs,
)
from scheduler.outputs import SeqSample


@dataclass
class DeviceSamples:
    """One step's draws on the device: row i drew tokens[i]; the rest is what its SeqSample reports."""

    tokens: torch.Tensor  # int64 [rows]
    deltas: torch.Tensor  # fp32 [rows]: log_softmax of the raw logits at each draw
    plan: _Plan
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # logprob_tensors' (top vals, ids, ranks)

    def tensors(self) -> list[torch.Tensor]:
        """Everything the host reads, in the order `to_seq_samples` takes it back."""
        return [self.tokens, self.deltas, *(self.logprobs or ())]

    def to_seq_samples(self, host: list[torch.Tensor]) -> list[SeqSample]:
        """The SeqSamples from `tensors()` as read back to the host (same order)."""
        tokens, deltas = host[0].tolist(), host[1].tolist()
        samples = [SeqSample([tok], [delta]) for tok, delta in zip(tokens, deltas, strict=True)]
        if self.logprobs is not None:
            offsets = list(range(len(tokens) + 1))
            top_vals, top_ids, ranks = (t.tolist() for t in host[2:5])
            write_logprobs(top_vals, top_ids, ranks, self.plan, offsets, deltas, samples)
        return samples


def sample_on_device(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata) -> DeviceSamples:
    """`sampler(logits, meta)`'s draws, left on logits' device (every row draws once)."""
    num_rows, vocab_size = logits.shape
    if any(n != 1 for n in meta.num_samples):
        raise ValueError("sample_on_device draws one token per row; a fork samples through Sampler.__call__")
    device = logits.device
    plan = _make_plan(meta, vocab_size)
    x = _process_logits(logits, meta, plan)
    tokens = torch.empty(num_rows, dtype=torch.long, device=device)
    # The stages run in Sampler.__call__'s order: the greedy argmax reads x before a sampled row consumes it.
    if plan.greedy_rows:
        g_x, rows_t = _select(x, plan.greedy_rows)
        greedy = g_x.argmax(dim=-1)
        if rows_t is None:
            tokens = greedy
        else:
            tokens[rows_t] = greedy
    for rows in plan.sampled.chunks(_chunk_rows(x)):
        drawn = sampler.race(x, x is not logits, meta, rows)
        tokens[torch.tensor(rows.rows, device=device)] = drawn
    # _raw_logprobs with one draw per row, chunked as there (a row's log_softmax never depends on its chunk)
    size = _chunk_rows(logits)
    delta_parts: list[torch.Tensor] = []
    lp_parts: list[torch.Tensor] = []
    lp_rows = plan.logprob_rows
    lp_next = 0
    for start in range(0, num_rows, size):
        end = min(start + size, num_rows)
        part = torch.log_softmax(logits[start:end], dim=-1)
        delta_parts.append(part.gather(1, tokens[start:end].unsqueeze(1)).squeeze(1))
        got, lp_next = window_rows(part, lp_rows, lp_next, start, end)
        if got is not None:
            lp_parts.append(got)
    deltas = torch.cat(delta_parts) if len(delta_parts) > 1 else delta_parts[0]
    logprobs = None
    if lp_parts:
        lp = torch.cat(lp_parts)
        offsets = list(range(num_rows + 1))
        tok_lp = deltas[torch.tensor(lp_rows, device=device)]
        logprobs = logprob_tensors(lp, plan, offsets, tok_lp)
    return DeviceSamples(tokens, deltas, plan, logprobs)
