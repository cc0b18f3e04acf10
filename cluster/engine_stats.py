"""EngineStatsCollector: turns the engine's state and its one output road into metrics records.

The controller (which owns the scheduler, the block manager and the stream of `RequestDelta`s
to every caller) asks this collector for

- `scheduler_stats()` after each step: the queues and the KV pool (a snapshot) plus the prefix
  cache lookups since the previous call (a delta of the block manager's running totals);
- `iteration_stats(deltas, ...)` for every batch of deltas it publishes (a step's, or the final
  deltas of aborted requests): tokens, TTFT, ITL and the finished requests, all counted from the
  deltas themselves, i.e. from exactly what callers receive. So `generation_tokens` equals the
  sum of the completion tokens in the usage blocks users see (tokens after a stop string, or of
  best_of samples that were not chosen, are never counted), and `prompt_tokens` counts each
  request's prompt once, with its first delta. With speculative decoding it also carries the
  scheduler's draft and acceptance counts since the previous call (vLLM's spec_decode counters).

Plain Python over the engine's objects: no Ray, no torch; unit-tested without a model.
Every time is `time.monotonic()` in the controller's process, the clock of `SequenceGroup`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cluster.lora_registry import LoadedAdapters
from cluster.metrics.stats import (
    FinishedRequestStats,
    FinishReason,
    IterationStats,
    LoRAStats,
    SchedulerStats,
    SpecDecodingStats,
)
from cluster.outputs import RequestDelta, RequestMetrics
from kv import BlockManager
from request.sampling_params import SamplingParams
from scheduler.outputs import SchedulerOutput
from scheduler.scheduler import Scheduler

_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class _Tracked:
    """What the metrics need of one request between its arrival and its final delta."""

    arrival_time: float
    n: int
    max_tokens: int | None
    num_prompt_tokens: int = 0  # known from the request's first delta (its PromptInfo)
    num_generation_tokens: int = 0  # tokens delivered so far, over all samples
    last_token_time: float | None = None  # when the previous delta with tokens went out
    finish_reason: FinishReason = "abort"  # of the last sample to finish; "abort" if none reported one


class EngineStatsCollector:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, loras: LoadedAdapters | None = None) -> None:
        """`loras`: the engine's adapters, for their names (only engines with enable_lora report LoRA stats)."""
        self._scheduler = scheduler
        self._bm = block_manager
        self._loras = loras if loras is not None and loras.enabled else None
        self._requests: dict[str, _Tracked] = {}
        # Running totals at the previous call: the stats records carry deltas.
        self._prefix_queries = block_manager.prefix_cache_queries
        self._prefix_hits = block_manager.prefix_cache_hits
        self._preemptions = self._num_preemptions()
        self._spec = self._spec_totals()  # None: the engine does not speculate

    def add_request(self, request_id: str, params: SamplingParams, arrival_time: float) -> None:
        self._requests[request_id] = _Tracked(arrival_time, params.n, params.max_tokens)

    def scheduler_stats(self) -> SchedulerStats:
        sched, bm = self._scheduler, self._bm
        queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
        stats = SchedulerStats(
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_swapped_reqs=len(sched.swapped),
            kv_cache_usage=min(max(bm.usage(), 0.0), 1.0),
            prefix_cache_queries=queries - self._prefix_queries,
            prefix_cache_hits=hits - self._prefix_hits,
            lora=self._lora_stats(),
        )
        self._prefix_queries, self._prefix_hits = queries, hits
        return stats

    def _lora_stats(self) -> LoRAStats | None:
        if self._loras is None:
            return None
        loras = self._loras

        def names(ids: set[int]) -> tuple[str, ...]:
            return tuple(sorted((a.lora_name if (a := loras.get(i)) is not None else str(i)) for i in ids))

        sched = self._scheduler
        return LoRAStats(names(sched.active_loras()), names(sched.waiting_loras()), sched.config.max_loras)

    def iteration_stats(
        self,
        deltas: Iterable[RequestDelta],
        now: float,
        so: SchedulerOutput | None = None,
        step_time: float | None = None,
    ) -> IterationStats:
        """The record for one batch of published deltas. `so` and `step_time` come with an engine
        step (None for deltas published outside one: aborts)."""
        preemptions = self._num_preemptions()
        stats = IterationStats(
            num_scheduled_tokens=so.num_scheduled_tokens if so is not None else 0,
            num_preempted_reqs=preemptions - self._preemptions,
            step_time=step_time,
        )
        self._preemptions = preemptions
        spec, prev = self._spec_totals(), self._spec
        if spec is not None and prev is not None:
            per_pos = zip(spec.num_accepted_tokens_per_pos, prev.num_accepted_tokens_per_pos, strict=True)
            stats.spec_decoding = SpecDecodingStats(
                num_drafts=spec.num_drafts - prev.num_drafts,
                num_draft_tokens=spec.num_draft_tokens - prev.num_draft_tokens,
                num_accepted_tokens=spec.num_accepted_tokens - prev.num_accepted_tokens,
                num_accepted_tokens_per_pos=tuple(a - b for a, b in per_pos),
            )
            self._spec = spec
        for delta in deltas:
            req = self._requests.get(delta.request_id)
            if req is None:  # not added through this collector
                continue
            if delta.prompt is not None:
                req.num_prompt_tokens = len(delta.prompt.token_ids)
                stats.num_prompt_tokens += req.num_prompt_tokens
            tokens = 0
            for sample in delta.samples:
                tokens += len(sample.token_ids)
                if sample.finish_reason is not None:
                    req.finish_reason = _REASONS.get(sample.finish_reason, "abort")
            if tokens:
                stats.num_generation_tokens += tokens
                req.num_generation_tokens += tokens
                if req.last_token_time is None:
                    stats.time_to_first_tokens.append(max(now - req.arrival_time, 0.0))
                else:  # one observation per request and step, as vLLM V1 does
                    stats.inter_token_latencies.append(max(now - req.last_token_time, 0.0))
                req.last_token_time = now
            if delta.finished:
                del self._requests[delta.request_id]
                stats.finished_requests.append(_finished(req, delta.metrics, now))
        return stats

    def _num_preemptions(self) -> int:
        return self._scheduler.num_preemptions_recompute + self._scheduler.num_preemptions_swap

    def _spec_totals(self) -> SpecDecodingStats | None:
        """The scheduler's speculative-decoding counters over the engine's life (None: no speculation)."""
        sched = self._scheduler
        if sched.config.speculative is None:
            return None
        return SpecDecodingStats(
            sched.spec_num_drafts,
            sched.spec_num_draft_tokens,
            sched.spec_num_accepted_tokens,
            tuple(sched.spec_accepted_per_pos),
        )


def _finished(req: _Tracked, m: RequestMetrics | None, now: float) -> FinishedRequestStats:
    """Phases as vLLM splits them: queued (arrival -> first scheduled), prefill (-> first token),
    decode (-> finished). A phase never reached lasts 0; times on one clock, clamped at 0."""
    arrival = req.arrival_time
    finished = m.finished_time if m is not None and m.finished_time is not None else now
    scheduled = m.first_scheduled_time if m is not None and m.first_scheduled_time is not None else finished
    first_token = m.first_token_time if m is not None and m.first_token_time is not None else finished
    return FinishedRequestStats(
        finish_reason=req.finish_reason,
        e2e_latency=max(finished - arrival, 0.0),
        num_prompt_tokens=req.num_prompt_tokens,
        num_generation_tokens=req.num_generation_tokens,
        max_tokens_param=req.max_tokens,
        n_param=req.n,
        queued_time=max(scheduled - arrival, 0.0),
        prefill_time=max(first_token - scheduled, 0.0),
        decode_time=max(finished - first_token, 0.0),
    )
