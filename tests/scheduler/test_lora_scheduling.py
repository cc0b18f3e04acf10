"""LoRA in the scheduler, without torch: the max_loras rule, its bound on passing a held request, the lora id
carried to the workers through preemption (recompute and swap), and salted prefix-cache blocks.

The fake worker keys every KV slot by (token, adapter) and samples from a hash of (context, adapter): a
sequence resumed without its adapter, or a cached block computed under another adapter, changes the output
or trips the KV check.
"""

from __future__ import annotations

import random

import pytest

from kv import BlockManager
from request.lora import NO_LORA
from request.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, NewSeqData, SchedulerOutput, SeqSample
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceStatus
from tests.scheduler.delta_worker import DeltaWorker

VOCAB = 1000
BLOCK = 4


def next_token(context: list[int], lora_id: int) -> int:
    return 1 + (hash((tuple(context), lora_id)) % (VOCAB - 1))  # never EOS (0)


def reference(prompt: list[int], lora_id: int, max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks, lora_id))
    return toks[len(prompt) :]


class LoRAWorker(DeltaWorker):
    """Rebuilds each sequence from the step deltas; KV slots hold (token, adapter)."""

    def __init__(self, num_blocks: int, max_loras: int) -> None:
        super().__init__(num_blocks, BLOCK)
        self.max_loras = max_loras
        self.lora: dict[int, int] = {}
        self.loras_per_step: list[set[int]] = []

    def on_new(self, new: NewSeqData) -> None:
        self.lora[new.seq_id] = new.lora_id

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        rows = self.apply(so)
        step_loras = {self.lora[seq_id] for seq_id, _, _ in rows} - {NO_LORA}
        assert len(step_loras) <= self.max_loras, f"step ran adapters {step_loras}"
        self.loras_per_step.append(step_loras)
        out = ModelRunnerOutput()
        for seq_id, computed, n in rows:
            toks, table, lora = self.tokens[seq_id], self.tables[seq_id], self.lora[seq_id]
            for p in range(computed):  # what the cache holds must be this sequence's, under its adapter
                assert self.kv[table[p // BLOCK]][p % BLOCK] == (toks[p], lora), (seq_id, p)
            for p in range(computed, computed + n):
                self.kv[table[p // BLOCK]][p % BLOCK] = (toks[p], lora)
            if seq_id in so.num_samples:
                out.samples[seq_id] = SeqSample(token_ids=[next_token(toks, lora)], cumulative_logprob_deltas=[-1.0])
        return out


def make(
    num_blocks: int = 64, max_loras: int = 2, prefix: bool = False, **cfg: object
) -> tuple[Scheduler, LoRAWorker, BlockManager]:
    bm = BlockManager(BLOCK, num_blocks, 64, enable_prefix_caching=prefix)
    config = SchedulerConfig(**{"max_model_len": 256, "max_loras": max_loras, **cfg})  # type: ignore[arg-type]
    return Scheduler(config, bm, (0,)), LoRAWorker(num_blocks, max_loras), bm


def add(sched: Scheduler, rid: str, prompt: list[int], lora_id: int, max_tokens: int = 12, gen: int = 1) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sched.add_request(rid, None, prompt, params, seed=1, lora_id=lora_id, lora_load_generation=gen)


def step(sched: Scheduler, worker: LoRAWorker, results: dict[str, list[int]]) -> None:
    so = sched.schedule()
    assert len(sched.active_loras()) <= sched.config.max_loras
    sched.update(so, worker.execute(so))
    for g in sched.take_finished():
        results[g.request_id] = g.seqs[0].output_token_ids


def run(sched: Scheduler, worker: LoRAWorker, max_steps: int = 3000) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, worker, results)
    assert not sched.has_unfinished_requests(), "scheduler did not finish"
    return results


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_loras=1, max_num_batched_tokens=9, max_num_seqs=3),
        dict(num_blocks=20, preemption_mode="recompute"),
        dict(num_blocks=20, preemption_mode="swap"),
        dict(num_blocks=24, prefix=True),
    ],
)
def test_mixed_adapters_match_reference_and_respect_max_loras(cfg: dict) -> None:
    rng = random.Random(3)
    sched, worker, bm = make(**cfg)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]  # same prompt under every adapter: salts keep them apart
    jobs = []
    for i in range(12):
        prompt = shared + [i] if i % 2 else [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))]
        jobs.append((str(i), prompt, i % 4))  # adapters 1, 2, 3 and the base model (0)
    for rid, prompt, lora in jobs:
        add(sched, rid, prompt, lora)
    results = run(sched, worker)
    for rid, prompt, lora in jobs:
        assert results[rid] == reference(prompt, lora, 12), rid
    assert max(len(s) for s in worker.loras_per_step) == sched.config.max_loras  # the limit was reached
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks
    if "preemption_mode" in cfg:
        assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0


def test_held_request_is_passed_by_active_adapters_and_base() -> None:
    sched, worker, _ = make(max_loras=1)
    results: dict[str, list[int]] = {}
    add(sched, "a", [1, 2, 3], lora_id=1, max_tokens=30)
    step(sched, worker, results)
    add(sched, "b", [4, 5, 6], lora_id=2)  # adapter 2 would be a second one: held
    add(sched, "c", [7, 8, 9], lora_id=1)  # adapter 1 is active: passes b
    add(sched, "d", [10, 11], lora_id=NO_LORA)  # the base model never counts
    step(sched, worker, results)
    assert [g.request_id for g in sched.waiting] == ["b"]
    assert {g.request_id for g in sched.running} == {"a", "c", "d"}
    assert sched.waiting[0].num_lora_bypasses == 1
    assert sched.waiting_loras() == {2} and sched.active_loras() == {1}
    run(sched, worker)


def test_held_request_is_not_starved_by_a_stream_of_active_adapter_requests() -> None:
    """Adapter-1 requests keep arriving; after max_num_seqs of them passed b, the rest wait behind it."""
    sched, worker, bm = make(max_loras=1, max_num_seqs=4)
    results: dict[str, list[int]] = {}
    add(sched, "first", [1, 2, 3], lora_id=1, max_tokens=4)
    step(sched, worker, results)
    add(sched, "b", [4, 5, 6], lora_id=2, max_tokens=4)
    admitted_at = None
    for t in range(60):
        add(sched, f"s{t}", [7, 8, t + 9], lora_id=1, max_tokens=4)
        add(sched, f"base{t}", [9, t + 1], lora_id=NO_LORA, max_tokens=2)
        step(sched, worker, results)
        b = sched.get_group("b")
        if b is None or b not in sched.waiting:
            admitted_at = t
            break
    assert admitted_at is not None, "the held request starved"
    b_group = next(g for g in sched.running if g.request_id == "b")
    assert b_group.num_lora_bypasses == sched.config.max_num_seqs
    assert sched.active_loras() == {2}
    # base-model requests kept flowing past it meanwhile
    assert all(f"base{t}" in results for t in range(admitted_at - 2))
    results.update(run(sched, worker))
    assert results["b"] == reference([4, 5, 6], 2, 4)
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_reloaded_adapter_id_never_hits_blocks_of_its_previous_load() -> None:
    sched, worker, _ = make(prefix=True)
    prompt = list(range(100, 117))
    add(sched, "old", prompt, lora_id=1, gen=1)
    run(sched, worker)
    add(sched, "new", prompt, lora_id=1, gen=2)  # id 1 loaded again: another adapter as far as the cache knows
    add(sched, "same", prompt, lora_id=1, gen=1)
    sched.schedule()
    groups = {g.request_id: g for g in sched.running}
    assert groups["new"].num_cached_tokens == 0
    assert groups["same"].num_cached_tokens == 16


def test_new_seq_data_carries_the_lora_id_and_preemption_keeps_it() -> None:
    sched, worker, _ = make(num_blocks=12, preemption_mode="recompute", max_num_batched_tokens=64)
    add(sched, "x", list(range(1, 20)), lora_id=3, max_tokens=30)
    add(sched, "y", list(range(30, 49)), lora_id=NO_LORA, max_tokens=30)
    so = sched.schedule()
    assert sorted(n.lora_id for n in so.new_seqs) == [NO_LORA, 3]
    sched.update(so, worker.execute(so))
    results = run(sched, worker)
    assert sched.num_preemptions_recompute > 0
    assert results["x"] == reference(list(range(1, 20)), 3, 30)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH_CAPPED for g in sched.take_finished() for s in g.seqs)


def test_max_loras_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_model_len=16, max_loras=0)
