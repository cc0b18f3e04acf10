"""EngineStatsCollector on a real engine (tiny random-weight Llama, in process): what it counts
equals what the requests' outputs hold, and its deltas add up to the engine's running totals."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.engine_stats import EngineStatsCollector
from cluster.metrics.stats import IterationStats, SchedulerStats
from cluster.outputs import RequestDelta, RequestOutput, RequestOutputBuilder
from request.sampling_params import SamplingParams
from scheduler.outputs import SchedulerOutput
from tests.helpers.tiny_models import make_tiny_llama

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


@pytest.fixture
def engine(model: str) -> LLMEngine:
    # 24 blocks of 4 tokens: the four 40-token requests below cannot all run at once (preemption).
    config = EngineConfig(
        model=model, block_size=BLOCK, num_gpu_blocks_override=24, distributed_executor_backend="inprocess"
    )
    return LLMEngine(config)


class Run:
    """Drives an engine step by step, as the controller does, feeding the collector what it publishes."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.collector = EngineStatsCollector(engine.scheduler, engine.block_manager)
        self.builders: dict[str, RequestOutputBuilder] = {}
        self.iterations: list[IterationStats] = []
        self.schedulers: list[SchedulerStats] = []

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        group = self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        self.collector.add_request(rid, params, group.arrival_time)
        self.builders[rid] = RequestOutputBuilder(rid)

    def publish(self, deltas: list[RequestDelta], so: SchedulerOutput | None = None) -> None:
        for d in deltas:
            self.builders[d.request_id].add(d)
        step_time = 0.01 if so is not None else None
        self.iterations.append(self.collector.iteration_stats(deltas, time.monotonic(), so, step_time))

    def step(self) -> None:
        so = self.engine.schedule()
        self.publish(self.engine.update(so, self.engine.execute(so)), so)
        self.schedulers.append(self.collector.scheduler_stats())

    def until_done(self) -> dict[str, RequestOutput]:
        while self.engine.has_unfinished_requests():
            self.step()
        return {rid: b.build() for rid, b in self.builders.items()}


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [10 + (seed * 7 + i * 13) % 250 for i in range(n)]


def test_counts_equal_what_the_requests_received(engine: LLMEngine) -> None:
    run = Run(engine)
    length = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=1)
    run.add("pair", _prompt(0), SamplingParams(n=2, max_tokens=6, ignore_eos=True, temperature=0.8, seed=2))
    run.add("stop", _prompt(1), SamplingParams(max_tokens=20, stop_token_ids=tuple(range(320)), temperature=0.0))
    for i in range(4):  # the same 40-token prompt four times: prefix cache hits, and too many blocks at once
        run.add(f"busy{i}", _prompt(2), length)
    outputs = run.until_done()
    its = run.iterations

    assert sum(it.num_generation_tokens for it in its) == sum(
        len(c.token_ids) for o in outputs.values() for c in o.outputs
    )
    assert sum(it.num_prompt_tokens for it in its) == sum(len(o.prompt_token_ids) for o in outputs.values())
    # Cached prefixes are not recomputed, so a step's scheduled tokens are not the prompts counted above.
    assert all(it.num_scheduled_tokens > 0 for it in its)
    assert sum(len(it.time_to_first_tokens) for it in its) == len(outputs)

    finished = {f.n_param: f for it in its for f in it.finished_requests}  # n=2 is the only request with n 2
    records = [f for it in its for f in it.finished_requests]
    assert len(records) == len(outputs), "one record per request, not per sequence"
    assert sorted(f.finish_reason for f in records) == sorted(
        str(o.outputs[-1].finish_reason) for o in outputs.values()
    )
    assert finished[2].num_generation_tokens == 12 and finished[2].max_tokens_param == 6
    for f in records:
        assert f.e2e_latency == pytest.approx(f.queued_time + f.prefill_time + f.decode_time)
    assert {f.finish_reason for f in records} == {"stop", "length"}

    # Stats records carry deltas: their sums are the engine's running totals.
    sched, bm = engine.scheduler, engine.block_manager
    preempted = sum(it.num_preempted_reqs for it in its)
    assert preempted == sched.num_preemptions_recompute + sched.num_preemptions_swap > 0
    assert sum(s.prefix_cache_queries for s in run.schedulers) == bm.prefix_cache_queries
    assert sum(s.prefix_cache_hits for s in run.schedulers) == bm.prefix_cache_hits > 0
    last = run.schedulers[-1]
    assert (last.num_running_reqs, last.num_waiting_reqs, last.num_swapped_reqs, last.kv_cache_usage) == (0, 0, 0, 0)


def test_an_abort_between_steps_is_a_finished_request(engine: LLMEngine) -> None:
    run = Run(engine)
    run.add("gone", _prompt(3), SamplingParams(max_tokens=50, ignore_eos=True, seed=3))
    while not run.iterations or not run.iterations[-1].num_generation_tokens:
        run.step()
    assert len(run.iterations[-1].time_to_first_tokens) == 1
    run.step()
    assert len(run.iterations[-1].inter_token_latencies) == 1
    engine.abort_request("gone")
    run.publish(engine.collect_finished())
    (record,) = run.iterations[-1].finished_requests
    assert record.finish_reason == "abort" and record.num_generation_tokens == 2
    assert record.max_tokens_param == 50 and record.n_param == 1


def test_spec_decoding_deltas_add_up_to_the_schedulers_counters(model: str) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    config = EngineConfig(
        model=model, block_size=BLOCK, num_gpu_blocks_override=64, distributed_executor_backend="inprocess",
        speculative_config=ngram,
    )  # fmt: skip
    run = Run(LLMEngine(config))
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for i in range(3):  # a prompt that repeats itself: prompt lookup proposes from the first step on
        run.add(f"loop{i}", [11 + i, 12, 13, 14] * 6, greedy)
    run.until_done()
    specs = [it.spec_decoding for it in run.iterations]
    assert all(s is not None and len(s.num_accepted_tokens_per_pos) == 3 for s in specs)
    sched = run.engine.scheduler
    assert sum(s.num_drafts for s in specs if s) == sched.spec_num_drafts > 0
    assert sum(s.num_draft_tokens for s in specs if s) == sched.spec_num_draft_tokens
    assert sum(s.num_accepted_tokens for s in specs if s) == sched.spec_num_accepted_tokens
    per_pos = [sum(s.num_accepted_tokens_per_pos[i] for s in specs if s) for i in range(3)]
    assert per_pos == sched.spec_accepted_per_pos and per_pos[0] > 0  # this tiny model accepts some
    # Every token the requests received is an accepted proposal or the target's own one per row and step.
    generated = sum(it.num_generation_tokens for it in run.iterations)
    assert generated == 3 * 24 and sched.spec_num_accepted_tokens < generated


def test_no_spec_decoding_stats_without_speculation(engine: LLMEngine) -> None:
    run = Run(engine)
    run.add("plain", _prompt(4), SamplingParams(max_tokens=4, ignore_eos=True))
    run.until_done()
    assert run.iterations and all(it.spec_decoding is None for it in run.iterations)
