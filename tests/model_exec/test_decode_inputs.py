"""A one-token-per-row step's inputs, built in one pass (`_decode_inputs`), equal the general road's
(`_spread_inputs`): token ids, positions, slots, lengths, block tables, and the draft model's one-token rows
that run a proposal instead of a known token."""

from __future__ import annotations

import random

import torch

from model_exec.model_runner import ModelRunner, _Row, _SeqState
from request.sampling_params import SamplingParams


def _runner(block_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # only the input builders run: no model, no TP group
    runner.block_size = block_size
    return runner


def _rows(rng: random.Random, block_size: int, with_proposals: bool) -> list[_Row]:
    rows = []
    for seq_id in range(40):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(1000) for _ in range(rng.randint(0, 30))]
        num_tokens = len(prompt) + len(output)
        # a decode (the newest token), or a one-token prompt chunk somewhere inside the prompt
        computed = num_tokens - 1 if rng.random() < 0.8 else rng.randrange(len(prompt))
        blocks = rng.sample(range(1, 500), -(-num_tokens // block_size) + rng.randint(0, 2))
        state = _SeqState(prompt, output, blocks, SamplingParams(), seed=0, sample_index=0, lora_id=0)
        drafts = [rng.randrange(1000)] if with_proposals and rng.random() < 0.5 else []
        rows.append(_Row(seq_id, state, computed, 1, drafts))
    return rows


def test_decode_inputs_equal_the_general_road() -> None:
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        for with_proposals in (False, True):
            runner = _runner(block_size)
            rows = _rows(rng, block_size, with_proposals)
            fast, general = runner._host_inputs(rows), runner._spread_inputs(rows)
            for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
                a, b = getattr(fast, name), getattr(general, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name
            assert (fast.starts, fast.max_query_len, fast.num_decodes) == (
                general.starts,
                general.max_query_len,
                general.num_decodes,
            )
            expected = [
                r.drafts[0] if r.drafts else (r.state.prompt_token_ids + r.state.output_token_ids)[r.num_computed]
                for r in rows
            ]
            assert fast.input_ids.tolist() == expected


def test_a_step_with_a_longer_row_takes_the_general_road() -> None:
    runner = _runner(4)
    rows = _rows(random.Random(1), 4, with_proposals=False)
    rows[3] = _Row(rows[3].seq_id, rows[3].state, 0, 2, [])
    host = runner._host_inputs(rows)
    assert host.max_query_len == 2 and host.num_decodes == len(rows) - 1
