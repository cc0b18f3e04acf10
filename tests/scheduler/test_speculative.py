"""Speculative decoding in the scheduler, without torch: config, the n-gram proposer, and KV accounting.

A fake worker rebuilds each sequence from the step deltas (as tests/scheduler/test_scheduler.py's does),
writes every scheduled slot (proposals included) into a fake KV, checks every computed slot holds its
sequence's token, and verifies proposals as rank 0 does: accept while the "target" agrees, then one token
of its own. The target is mostly a function of the last token (so runs repeat and n-gram proposals are
often accepted) and sometimes of the whole context (so some are rejected). Outputs must equal a run
without speculation, and every block must come back.
"""

from __future__ import annotations

import random

import pytest

from kv import BlockManager
from request.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.outputs import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput, SeqSample
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpeculativeConfig, propose_ngram
from tests.scheduler.delta_worker import DeltaWorker

VOCAB = 1000
EOS = 0
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "/draft", "num_speculative_tokens": 3}  # the fake worker drafts


def target(context: list[int]) -> int:
    """The fake model's greedy token: a short cycle keyed by the last token, broken now and then."""
    if hash(tuple(context)) % 5 == 0:
        return 1 + hash(tuple(context)) % (VOCAB - 1)
    return 1 + (context[-1] * 7) % 23


def fake_draft(context: list[int], k: int) -> list[int]:
    """A draft model's greedy proposals: the target's token two times in three, another one otherwise."""
    out: list[int] = []
    for _ in range(k):
        guess = target(context + out)
        out.append(guess if hash(tuple(context + out)) % 3 else 1 + guess % (VOCAB - 1))
    return out


class VerifyingWorker(DeltaWorker):
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        rows = self.apply(so)
        out = ModelRunnerOutput()
        for seq_id, computed, n in rows:
            drafts = so.spec_token_ids.get(seq_id, [])
            if drafts and drafts[0] == PLACEHOLDER_TOKEN:  # draft_model: rank 0's draft fills them
                drafts = fake_draft(self.tokens[seq_id], len(drafts))
            toks, table = self.tokens[seq_id] + drafts, self.tables[seq_id]
            assert computed + n <= len(toks) and len(table) * self.block_size >= computed + n
            for p in range(computed):  # what the KV cache encodes: the sequence's tokens, never a rejected proposal
                assert self.kv[table[p // self.block_size]][p % self.block_size] == toks[p], (seq_id, p)
            for p in range(computed, computed + n):
                self.kv[table[p // self.block_size]][p % self.block_size] = toks[p]
            if seq_id not in so.num_samples:
                continue
            assert computed + n == len(toks)
            known = self.tokens[seq_id]
            if so.num_samples[seq_id] > 1:  # the fork after the prompt (never with proposals)
                assert not drafts
                k = so.num_samples[seq_id]
                out.samples[seq_id] = SeqSample(token_ids=[target(known)] * k, cumulative_logprob_deltas=[-1.0] * k)
                continue
            emitted = []
            for j in range(len(drafts) + 1):
                emitted.append(target(known + drafts[:j]))
                if j == len(drafts) or emitted[-1] != drafts[j]:
                    break
            out.samples[seq_id] = SeqSample(token_ids=emitted, cumulative_logprob_deltas=[-1.0] * len(emitted))
        return out


def make(num_blocks: int = 64, block_size: int = 4, prefix: bool = False, spec: dict | None = NGRAM, **cfg: object):
    bm = BlockManager(block_size, num_blocks, 64, enable_prefix_caching=prefix)
    speculative = SpeculativeConfig.from_dict(spec) if spec is not None else None
    config = SchedulerConfig(**{"max_model_len": 256, "speculative": speculative, **cfg})  # type: ignore[arg-type]
    return Scheduler(config, bm, (EOS,)), VerifyingWorker(num_blocks, block_size), bm


def run(sched: Scheduler, worker: VerifyingWorker, abort: set[str] = frozenset(), max_steps: int = 3000) -> dict:
    results, step = {}, 0
    while sched.has_unfinished_requests():
        step += 1
        assert step < max_steps, "scheduler did not finish"
        so = sched.schedule()
        assert so.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        sched.update(so, worker.execute(so))
        sched.block_manager.check_invariants()
        for rid in sorted(abort):
            if step % 7 == int(rid) % 7:
                sched.abort_request(rid)
        for g in sched.take_finished():
            results[g.request_id] = [s.output_token_ids for s in g.seqs]
    return results


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(target(toks))
    return toks[len(prompt) :]


def add(sched: Scheduler, rid: str, prompt: list[int], **params: object) -> None:
    sched.add_request(rid, None, prompt, SamplingParams(**{"temperature": 0.0, **params}), seed=1)  # type: ignore[arg-type]


def prompts(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_num_batched_tokens=7, max_num_seqs=3),
        dict(num_blocks=24, preemption_mode="recompute"),
        dict(num_blocks=24, preemption_mode="swap"),
        dict(num_blocks=24, prefix=True),
        dict(num_blocks=24, preemption_mode="swap", spec=DRAFT),
        dict(num_blocks=24, prefix=True, spec=DRAFT),
    ],
)
def test_outputs_equal_a_run_without_speculation_and_every_block_comes_back(cfg: dict) -> None:
    rng = random.Random(0)
    sched, worker, bm = make(**cfg)
    ps = prompts(12, rng)
    for i, p in enumerate(ps):
        add(sched, str(i), p, max_tokens=30, ignore_eos=True)
    results = run(sched, worker)
    for i, p in enumerate(ps):
        assert results[str(i)] == [reference(p, 30)]
    assert sched.spec_num_accepted_tokens > 0 and sched.spec_num_draft_tokens > sched.spec_num_accepted_tokens
    assert sum(sched.spec_accepted_per_pos) == sched.spec_num_accepted_tokens
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_200_requests_with_aborts_and_preemption_free_every_block_and_cache_only_accepted_tokens(spec: dict) -> None:
    rng = random.Random(3)
    sched, worker, bm = make(num_blocks=40, prefix=True, max_num_batched_tokens=24, spec=spec)
    ps = prompts(200, rng)
    aborted = {str(i) for i in range(0, 200, 9)}
    for i, p in enumerate(ps):
        add(sched, str(i), p, max_tokens=rng.randrange(1, 40), ignore_eos=True)
    results = run(sched, worker, abort=aborted)
    assert sched.num_preemptions_recompute + sched.num_preemptions_swap > 0
    assert sched.spec_num_accepted_tokens > 0
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks
    # Whatever the prefix cache kept holds accepted tokens only: rerun every finished sequence as a prompt
    # (its full blocks hit the cache), and the worker checks each cached slot against the prompt.
    hits_before = bm.prefix_cache_hits
    for rid, outs in reversed(list(results.items())[-10:]):  # the latest first: still cached (LRU)
        add(sched, "again-" + rid, ps[int(rid)] + outs[0], max_tokens=2, ignore_eos=True)
        run(sched, worker)
    assert bm.prefix_cache_hits > hits_before
    assert bm.num_free_device_blocks == bm.num_device_blocks


def test_a_stop_inside_an_accepted_run_ends_the_output_at_that_token() -> None:
    prompt = [3, 4, 5] * 4
    ref = reference(prompt, 20)
    for stop_at in (2, 5, 9):
        sched, worker, _ = make()
        add(sched, "a", prompt, max_tokens=20, stop_token_ids=[ref[stop_at]])
        add(sched, "b", prompt, max_tokens=stop_at + 1, ignore_eos=True)
        results = run(sched, worker)
        first = ref.index(ref[stop_at])
        assert results["a"] == [ref[: first + 1]]
        assert results["b"] == [ref[: stop_at + 1]]
    assert sched.spec_num_accepted_tokens > 0


def test_forks_and_the_last_allowed_token_never_speculate() -> None:
    sched, worker, _ = make()
    cycle = reference([5], 12)
    prompt = [5, *cycle, 5]
    sched.add_request("fork", None, prompt, SamplingParams(n=2, max_tokens=12, ignore_eos=True), 7)
    so = sched.schedule()
    assert not so.spec_token_ids and so.num_samples == {so.new_seqs[0].seq_id: 2}  # the prompt step forks
    sched.update(so, worker.execute(so))
    speculated = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        speculated += len(so.spec_token_ids)
        sched.update(so, worker.execute(so))
    assert speculated > 0  # the forked samples decode and speculate
    sched, worker, _ = make(max_model_len=len(prompt) + 2)
    add(sched, "a", prompt, max_tokens=50, ignore_eos=True)
    so = sched.schedule()
    sched.update(so, worker.execute(so))
    so = sched.schedule()
    assert not so.spec_token_ids  # one position left: the target's own token is the last one allowed
    sched.update(so, worker.execute(so))
    (group,) = sched.take_finished()
    assert group.seqs[0].output_token_ids == reference(prompt, 2)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)
    cfg = SpeculativeConfig.from_dict(NGRAM)
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], cfg, 4) == [7, 8, 5, 1]  # latest of two matches
    assert propose_ngram([5, 6, 7, 1, 2, 9, 9, 7, 1, 2], cfg, 2) == [9, 9]  # longest suffix first
    assert propose_ngram([1, 2, 3, 4], cfg, 4) == []  # no earlier occurrence
    assert propose_ngram([4, 4], cfg, 4) == [4]  # the continuation stops at the end
    assert propose_ngram([1, 2, 1, 2], cfg, 0) == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, 'draft_model" only'),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "ngram"),
        ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "must be a path"),
        ({"num_speculative_tokens": 2}, "method"),
    ],
)
def test_a_bad_config_is_refused_by_name(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(raw)


def test_a_draft_model_config_reads_vllms_spellings() -> None:
    """vLLM's `{"model": PATH}` without a method names a draft model; `{"model": "[ngram]"}` prompt lookup."""
    draft = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/m", 3)
    ngram = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (ngram.method, ngram.model, ngram.prompt_lookup_min) == ("ngram", None, 2)


def test_draft_model_rows_carry_placeholders_under_the_same_limits() -> None:
    """With a draft model the scheduler cannot know the proposals: it schedules k placeholders (rank 0's draft
    fills them), never past max_tokens, and the accepted run is applied as for n-gram proposals."""
    spec = {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    sched, _, bm = make(spec=spec)
    add(sched, "0", [5, 6, 7], max_tokens=3, ignore_eos=True)
    so = sched.schedule()  # the prompt
    sched.update(so, ModelRunnerOutput(samples={so.num_samples.popitem()[0]: SeqSample([9], [-1.0])}))
    so = sched.schedule()
    [(seq_id, drafts)] = so.spec_token_ids.items()
    assert drafts == [PLACEHOLDER_TOKEN]  # 3 tokens allowed, 1 out: the target's own after one proposal is the last
    sched.update(so, ModelRunnerOutput(samples={seq_id: SeqSample([4, 8], [-1.0, -1.0])}))
    [group] = sched.take_finished()
    assert group.seqs[0].output_token_ids == [9, 4, 8]
    assert sched.spec_num_accepted_tokens == 1 and bm.num_free_device_blocks == bm.num_device_blocks
