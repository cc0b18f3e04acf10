"""Scheduler tests without torch: a fake worker rebuilds every sequence from the step deltas alone.

The fake "model" samples next = hash of the whole context, so if a delta (tokens or block
table) were lost or duplicated, the generated tokens would differ from a reference run
that never preempts, chunks or swaps.
"""

from __future__ import annotations

import random

import pytest

from kv import BlockManager
from request.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, NewSeqData, SchedulerOutput, SeqSample
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from tests.scheduler.delta_worker import DeltaWorker

VOCAB = 1000
EOS = 0


def next_token(context: list[int], sample_index: int) -> int:
    return 1 + (hash((tuple(context), sample_index)) % (VOCAB - 1))  # never EOS


class FakeWorker(DeltaWorker):
    """Holds per-seq state from deltas, checks block tables, 'computes' KV slots, samples deterministically."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.sample_index: dict[int, int] = {}
        self.rows_per_step: list[int] = []
        self.tokens_per_step: list[int] = []

    def on_new(self, new: NewSeqData) -> None:
        self.sample_index[new.seq_id] = new.sample_index

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        rows = self.apply(so)
        self.rows_per_step.append(len(rows))
        self.tokens_per_step.append(sum(n for _, _, n in rows))
        out = ModelRunnerOutput()
        for seq_id, computed, n in rows:
            toks, table = self.tokens[seq_id], self.tables[seq_id]
            # every cached position must hold the right token (this is what the KV cache would encode)
            for p in range(computed):
                assert self.kv[table[p // self.block_size]][p % self.block_size] == toks[p], (seq_id, p)
            for p in range(computed, computed + n):
                self.kv[table[p // self.block_size]][p % self.block_size] = toks[p]
            if seq_id in so.num_samples:
                assert computed + n == len(toks)
                k = so.num_samples[seq_id]
                base = self.sample_index[seq_id]
                ids = [next_token(toks, base + j) for j in range(k)]
                out.samples[seq_id] = SeqSample(token_ids=ids, cumulative_logprob_deltas=[-1.0] * k)
        return out


def make(num_blocks: int = 64, block_size: int = 4, num_cpu: int = 64, prefix: bool = False, **cfg: object):
    bm = BlockManager(block_size, num_blocks, num_cpu, enable_prefix_caching=prefix)
    config = SchedulerConfig(**{"max_model_len": 256, **cfg})  # type: ignore[arg-type]
    return Scheduler(config, bm, (EOS,)), FakeWorker(num_blocks, block_size), bm


def run(sched: Scheduler, worker: FakeWorker, max_steps: int = 2000) -> dict[str, list[list[int]]]:
    results: dict[str, list[list[int]]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(so.new_seqs) + len(so.cached_seqs) <= sched.config.max_num_seqs
        sched.update(so, worker.execute(so))
        for g in sched.take_finished():
            results[g.request_id] = [s.output_token_ids for s in g.seqs]
    assert not sched.has_unfinished_requests(), "scheduler did not finish"
    return results


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks, 0))
    return toks[len(prompt) :]


def add(sched: Scheduler, rid: str, prompt: list[int], **params: object) -> None:
    sched.add_request(rid, None, prompt, SamplingParams(**{"temperature": 0.0, **params}), seed=1)  # type: ignore[arg-type]


def prompts(n: int, rng: random.Random, lo: int = 3, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_num_batched_tokens=7, max_num_seqs=3),  # heavy chunking, few rows
        dict(num_blocks=24, preemption_mode="recompute"),
        dict(num_blocks=24, preemption_mode="swap"),
        dict(num_blocks=24, prefix=True),
    ],
)
def test_outputs_match_reference_under_chunking_and_preemption(cfg: dict) -> None:
    rng = random.Random(0)
    sched, worker, bm = make(**cfg)
    ps = prompts(10, rng)
    for i, p in enumerate(ps):
        add(sched, str(i), p, max_tokens=20, ignore_eos=True)
    results = run(sched, worker)
    for i, p in enumerate(ps):
        assert results[str(i)] == [reference(p, 20)]
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    if "preemption_mode" in cfg:
        mode = cfg["preemption_mode"]
        count = sched.num_preemptions_swap if mode == "swap" else sched.num_preemptions_recompute
        assert count > 0, "the pool was meant to be small enough to force preemption"


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    sched, worker, _ = make(max_num_batched_tokens=8)
    add(sched, "a", [5, 6, 7], max_tokens=10, ignore_eos=True)
    sched.update(so := sched.schedule(), worker.execute(so))  # a: prefill done, one token sampled
    add(sched, "b", list(range(1, 30)), max_tokens=2, ignore_eos=True)
    so = sched.schedule()
    by_id = {c.seq_id: c.num_scheduled_tokens for c in so.cached_seqs}
    assert list(by_id.values()) == [1]  # a's decode
    assert so.new_seqs[0].num_scheduled_tokens == 7  # b gets what is left of the budget
    sched.update(so, worker.execute(so))


def test_running_requests_travel_as_deltas() -> None:
    sched, worker, _ = make()
    add(sched, "a", list(range(1, 20)), max_tokens=5, ignore_eos=True)
    so = sched.schedule()
    assert len(so.new_seqs) == 1 and not so.cached_seqs
    sched.update(so, worker.execute(so))
    so = sched.schedule()
    assert not so.new_seqs
    (c,) = so.cached_seqs
    assert len(c.new_token_ids) == 1 and c.num_scheduled_tokens == 1
    sched.update(so, worker.execute(so))


def test_prompt_that_can_never_fit_is_ignored_and_others_run() -> None:
    sched, worker, bm = make(num_blocks=8, block_size=4)
    add(sched, "huge", list(range(1, 40)), max_tokens=2)  # 10 blocks > 8
    add(sched, "ok", [1, 2, 3], max_tokens=3, ignore_eos=True)
    so = sched.schedule()
    finished = {g.request_id: g for g in sched.take_finished()}
    assert finished["huge"].seqs[0].status is SequenceStatus.FINISHED_IGNORED
    assert "KV blocks" in (finished["huge"].error or "")
    sched.update(so, worker.execute(so))
    assert run(sched, worker)["ok"] == [reference([1, 2, 3], 3)]
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_prompt_longer_than_max_model_len_is_ignored() -> None:
    sched, worker, _ = make(max_model_len=16)
    add(sched, "long", list(range(1, 30)), max_tokens=2)
    sched.schedule()
    (g,) = sched.take_finished()
    assert g.seqs[0].status is SequenceStatus.FINISHED_IGNORED and "max_model_len" in (g.error or "")


@pytest.mark.parametrize("when", [0, 1, 3, 6])
def test_abort_at_any_point_frees_everything(when: int) -> None:
    sched, worker, bm = make(num_blocks=20, max_num_batched_tokens=6, preemption_mode="swap")
    rng = random.Random(1)
    for i, p in enumerate(prompts(6, rng, 5, 20)):
        add(sched, str(i), p, max_tokens=30, ignore_eos=True)
    for _ in range(when):
        sched.update(so := sched.schedule(), worker.execute(so))
    for rid in ["0", "3", "5"]:
        sched.abort_request(rid)
    results = run(sched, worker)
    assert {"1", "2", "4"} <= set(results)
    assert bm.num_free_device_blocks == bm.num_device_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    bm.check_invariants()


def test_best_of_forks_after_prefill_and_copies_the_shared_partial_block() -> None:
    sched, worker, bm = make(block_size=4)
    sched.add_request("a", None, [1, 2, 3, 4, 5, 6], SamplingParams(n=2, best_of=3, max_tokens=4, ignore_eos=True), 7)
    so = sched.schedule()
    assert so.num_samples == {so.new_seqs[0].seq_id: 3}
    sched.update(so, worker.execute(so))
    group = sched.get_group("a")
    assert group is not None and len(group.seqs) == 3
    so = sched.schedule()
    # the prompt's last block (tokens 5, 6) is shared by three sequences: two of them copy it
    assert len(so.blocks_to_copy) == 2
    sched.update(so, worker.execute(so))
    results = run(sched, worker)
    outs = results["a"]
    assert len(outs) == 3 and all(len(o) == 4 for o in outs)
    assert len({tuple(o) for o in outs}) == 3  # different sample streams
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_auto_mode_swaps_multi_sequence_requests() -> None:
    sched, worker, bm = make(num_blocks=14, block_size=4)
    for i in range(3):
        sched.add_request(
            str(i), None, list(range(1 + i, 9 + i)), SamplingParams(n=2, max_tokens=12, ignore_eos=True), i
        )
    run(sched, worker)
    assert sched.num_preemptions_swap > 0
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_stop_token_ids_and_min_tokens() -> None:
    sched, worker, _ = make()
    prompt = [3, 4, 5]
    ref = reference(prompt, 10)
    add(sched, "a", prompt, max_tokens=10, stop_token_ids=[ref[2]])
    add(sched, "b", prompt, max_tokens=10, stop_token_ids=[ref[0]], min_tokens=3)
    results = run(sched, worker)
    assert results["a"] == [ref[:3]]
    # b's stop token came before min_tokens, so it is not a stop there (the real sampler also masks it)
    assert len(results["b"][0]) >= 3


def test_prefix_cache_hits_skip_computation() -> None:
    sched, worker, bm = make(prefix=True, block_size=4)
    shared = list(range(1, 17))  # four full blocks
    add(sched, "a", shared + [50], max_tokens=2, ignore_eos=True)
    run(sched, worker)
    add(sched, "b", shared + [60, 61], max_tokens=2, ignore_eos=True)
    so = sched.schedule()
    assert so.new_seqs[0].num_computed_tokens == 16
    sched.update(so, worker.execute(so))
    results = run(sched, worker)
    assert results["b"] == [reference(shared + [60, 61], 2)]
