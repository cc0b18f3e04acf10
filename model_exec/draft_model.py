"""Speculative decoding with a draft model: rank 0's smaller model proposes the tokens the target verifies.

`{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`. The scheduler schedules a decoding
row as [its last token + m placeholder proposals] (m <= k; scheduler/speculative.py), with lookahead slots
for all of them; before the target's forward, `DraftModel.propose` fills the placeholders with the draft's
tokens, and the target verifies them as it verifies n-gram proposals (model_exec/spec_verify.py).

Layout (decision): the draft runs whole (tensor parallel size 1) on rank 0 only, with its own KV pool of the
same block ids as the target's: one block id names a block in both pools, so the block manager's tables,
lookahead slots, copy-on-write copies and swaps serve both, and a rejected proposal's draft KV is freed with
its target KV. Rank 0 broadcasts the proposals to the other ranks (model_runner.py). A draft replicated on
every rank would compute the same tokens n times over.

Invariant: the draft's KV holds every position the target's holds, except perhaps the one before a row's
newest token (a proposal accepted last step that the draft never read). Each step the draft runs every
row's scheduled tokens (prefill chunks as they are), and every decoding row from one position back
([previous token, newest token]): that fills the gap and rewrites an equal entry otherwise. Then it decodes
m - 1 more tokens for each row that speculates, greedily.

Decision: the draft proposes its argmax (a one-hot q), as vLLM's V1 draft proposers do, so verification is
the rule it already is for n-gram proposals (accept d with probability p(d), else draw from p without d): the
output keeps the target's distribution, and a seeded request gives the same tokens with or without the draft.
A draft can only change how many tokens are accepted, never which tokens are emitted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from model_exec.models import CausalLM
from ops.cache_ops import KVCache
from scheduler.outputs import PLACEHOLDER_TOKEN


class StepRow(Protocol):
    """What the draft reads and sets of the model runner's rows (model_runner._Row); a protocol, so this
    module imports nothing of the runner's."""

    num_computed: int
    num_scheduled: int
    drafts: list[int]


class StepInputs(Protocol):
    starts: list[int]  # each row's first token in the step's flat token order, and the end


Row = TypeVar("Row", bound=StepRow)


def has_placeholders(row: StepRow) -> bool:
    """A row whose proposals the draft has to make (the scheduler sent placeholders)."""
    return bool(row.drafts) and row.drafts[0] == PLACEHOLDER_TOKEN


def _at(row: Row, num_computed: int, num_scheduled: int, drafts: list[int]) -> Row:
    """The row at other counts (a shallow copy: the sequence's state is shared, not copied)."""
    moved = copy.copy(row)
    moved.num_computed, moved.num_scheduled, moved.drafts = num_computed, num_scheduled, drafts
    return moved


class DraftModel:
    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.kv_caches: list[KVCache] | None = None  # the draft's pool, set once the engine sized the target's

    @torch.inference_mode()
    def propose(
        self,
        rows: Sequence[Row],
        host_inputs: Callable[[list[Row]], Any],
        forward: Callable[[CausalLM, Any, list[KVCache]], torch.Tensor],
    ) -> None:
        """Run the draft over the step's rows (its KV kept in step with the target's), then replace each row's
        placeholder proposals with the draft's greedy tokens, in place. `host_inputs` builds a step's inputs
        (a StepInputs) from rows, `forward` runs a model on them: the runner's own."""
        assert self.kv_caches is not None, "the draft's KV pool is set by ModelShard.init_cache"
        first: list[Row] = []
        for r in rows:
            if r.drafts or (r.num_scheduled == 1 and r.num_computed > 0):
                # a decoding row (or a one-token prompt chunk): from one position back, [previous, newest]
                first.append(_at(r, r.num_computed - 1, 2, []))
            else:
                first.append(_at(r, r.num_computed, r.num_scheduled, []))
        speculating = [i for i, r in enumerate(rows) if has_placeholders(r)]
        # attention backends take one-token rows first: this pass has none but one-token prompts, kept first
        order = sorted(range(len(first)), key=lambda i: first[i].num_scheduled != 1)
        host: StepInputs = host_inputs([first[i] for i in order])
        hidden = forward(self.model, host, self.kv_caches)
        if not speculating:
            return
        where = {row: pos for pos, row in enumerate(order)}
        last = [host.starts[where[i] + 1] - 1 for i in speculating]
        proposals: dict[int, list[int]] = {i: [t] for i, t in zip(speculating, self._greedy(hidden, last), strict=True)}
        # one more token per speculating row and pass, each from the draft's own previous proposal
        for j in range(1, max(len(rows[i].drafts) for i in speculating)):
            going = [i for i in speculating if len(rows[i].drafts) > j]
            step = [_at(rows[i], rows[i].num_computed + j, 1, [proposals[i][-1]]) for i in going]
            hidden = forward(self.model, host_inputs(step), self.kv_caches)
            for i, token in zip(going, self._greedy(hidden, list(range(len(going)))), strict=True):
                proposals[i].append(token)
        for i in speculating:
            rows[i].drafts = proposals[i]

    def _greedy(self, hidden: torch.Tensor, positions: list[int]) -> list[int]:
        logits = self.model.compute_logits(hidden[torch.tensor(positions, device=hidden.device)])
        assert logits is not None, "the draft runs on its own one-rank group: it always gets its logits"
        return logits.argmax(dim=-1).tolist()
