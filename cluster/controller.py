"""EngineController: one model replica's engine as an async Ray actor that streams per request.

The actor owns the LLMEngine (scheduler, block manager, executor -> TP worker actors).
Callers (the Serve ingress) open one stream per request:

    gen = controller.generate.options(num_returns="streaming").remote(rid, ids, params)

and receive `RequestDelta`s (cluster/protocol.py): token ids only, since callers own the
tokenizer, detokenize, apply stop strings and `abort` when one hits.

Threading invariant: every scheduler/block-manager change (add, abort, schedule, update,
fail) happens on the actor's event loop thread; only `engine.execute` (the workers' forward
pass) runs in the one step thread. So adds and aborts land between or during steps without
locks, and the scheduler already tolerates a request aborted while its step is in flight.
The step loop runs only while requests are in flight; the first new request restarts it.

Decision: unless the config says `distributed_executor_backend="inprocess"`, the controller
runs even TP=1 through the Ray executor, so the model sits in a placed worker actor that
holds the GPU/CPU bundle, and the controller actor itself needs no accelerator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import EngineConfig
from cluster.engine import EngineDeadError, LLMEngine
from cluster.protocol import RequestDelta, SeqDelta
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import SequenceGroup

logger = logging.getLogger(__name__)

MAX_CONCURRENT_CALLS = 4096  # each open stream holds one actor call slot for its lifetime


@dataclass
class _Stream:
    """One caller's view of a request: what was already sent for each of its sequences."""

    group: SequenceGroup
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)
    tokens_sent: dict[int, int] = field(default_factory=dict)  # seq_id -> output tokens already streamed
    logprobs_sent: dict[int, int] = field(default_factory=dict)  # seq_id -> logprob entries already streamed
    finish_sent: set[int] = field(default_factory=set)  # seq_ids whose finish_reason was streamed
    started: bool = False  # the first delta (with the prompt) went out
    done: bool = False  # the final delta is queued; nothing more is sent


@ray.remote(num_cpus=0, max_concurrency=MAX_CONCURRENT_CALLS)  # type: ignore[call-overload]  # actor options untyped
class EngineController:
    def __init__(self, config: EngineConfig) -> None:
        if config.distributed_executor_backend is None:
            config = dataclasses.replace(config, distributed_executor_backend="ray")
        # The executor blocks in ray.get, but only here (start-up, before any request) and on the step and
        # health threads, never on the event loop; so Ray's warning about blocking gets in async actors is noise.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self.engine = LLMEngine(config, detokenize=False)
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytp-step")
        self._streams: dict[str, _Stream] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas; the last has finished=True. Bad input raises ValueError here."""
        stream = self._add(request_id, prompt_token_ids, params)
        try:
            while True:
                delta = await stream.queue.get()
                yield delta
                if delta.finished:
                    return
        finally:
            # Reached early only when the caller cancelled or closed the stream: free the request's blocks.
            if not stream.done:
                self._abort(request_id)
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> _Stream:
        if self._closed:
            raise EngineDeadError("the controller is shut down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        group = self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params)
        stream = _Stream(group)
        self._streams[request_id] = stream
        self._num_prompt_tokens += len(group.prompt_token_ids)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        return stream

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            self._publish([stream.group])

    # ------------------------------------------------------------------ step loop
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.engine.has_unfinished_requests() and self.engine.dead is None:
            so = self.engine.schedule()
            try:
                result = await loop.run_in_executor(self._step_thread, self.engine.execute, so)
            except Exception as e:
                self._on_engine_failure(e)
                return
            self._publish(self.engine.update(so, result))
            # Let queued adds/aborts and stream consumers run; an empty step (nothing schedulable) backs off.
            await asyncio.sleep(0 if not so.is_empty else 0.005)

    def _on_engine_failure(self, error: BaseException) -> None:
        """Every request in flight ends with the error (its final delta says which rank failed)."""
        if self.engine.dead is None:
            logger.error("engine step failed: %s", error)
            self.engine.fail(error)
        self._publish([s.group for s in self._streams.values()])

    def _publish(self, groups: list[SequenceGroup]) -> None:
        for group in groups:
            stream = self._streams.get(group.request_id)
            if stream is None or stream.done or stream.group is not group:
                continue
            delta = self._delta(stream)
            if delta is not None:
                stream.queue.put_nowait(delta)
                stream.done = delta.finished

    def _delta(self, stream: _Stream) -> RequestDelta | None:
        """What changed since the last delta, built from scheduler state; None when nothing did."""
        group = stream.group
        want_logprobs = group.sampling_params.logprobs is not None
        seqs: list[SeqDelta] = []
        for seq in group.seqs:
            sent = stream.tokens_sent.get(seq.seq_id, 0)
            new_ids = seq.output_token_ids[sent:]
            ends_now = seq.is_finished and seq.seq_id not in stream.finish_sent
            if not new_ids and not ends_now:
                continue
            new_logprobs = None
            if want_logprobs:
                lp_sent = stream.logprobs_sent.get(seq.seq_id, 0)
                new_logprobs = seq.output_logprobs[lp_sent:]
                stream.logprobs_sent[seq.seq_id] = lp_sent + len(new_logprobs)
            stream.tokens_sent[seq.seq_id] = sent + len(new_ids)
            self._num_generation_tokens += len(new_ids)
            if ends_now:
                stream.finish_sent.add(seq.seq_id)
            seqs.append(
                SeqDelta(
                    index=seq.sample_index,
                    new_token_ids=new_ids,
                    new_logprobs=new_logprobs,
                    cumulative_logprob=seq.cumulative_logprob,
                    finish_reason=seq.status.finish_reason if seq.is_finished else None,
                    stop_reason=seq.stop_reason,
                )
            )
        finished = group.is_finished
        if not seqs and not finished:
            return None
        first = not stream.started
        stream.started = True
        return RequestDelta(
            request_id=group.request_id,
            seqs=seqs,
            prompt_token_ids=list(group.prompt_token_ids) if first else None,
            prompt_logprobs=list(group.prompt_logprobs) if first and group.prompt_logprobs is not None else None,
            finished=finished,
            error=group.error if finished else None,
        )

    # ------------------------------------------------------------------ health, stats, lifecycle
    async def check_health(self) -> None:
        """Raise if the engine cannot serve: a worker died or a step failed (then Serve replaces the replica)."""
        if self.engine.dead is None and not self._closed:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.engine.executor.check_health)
            except Exception as e:
                self._on_engine_failure(e)
        if self.engine.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.engine.dead}")
        if self._closed:
            raise EngineDeadError("the controller is shut down")

    async def get_stats(self) -> dict[str, Any]:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        queries = bm.prefix_cache_queries
        return {
            "num_requests": len(self._streams),
            "num_waiting": len(sched.waiting),
            "num_running": len(sched.running),
            "num_swapped": len(sched.swapped),
            "num_free_device_blocks": bm.num_free_device_blocks,
            "num_device_blocks": bm.num_device_blocks,
            "num_free_cpu_blocks": bm.num_free_cpu_blocks,
            "num_cpu_blocks": bm.num_cpu_blocks,
            "kv_usage": bm.usage(),
            "num_preemptions": sched.num_preemptions_recompute + sched.num_preemptions_swap,
            "num_preemptions_recompute": sched.num_preemptions_recompute,
            "num_preemptions_swap": sched.num_preemptions_swap,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": bm.prefix_cache_hits / queries if queries else 0.0,
            "prompt_tokens_total": self._num_prompt_tokens,
            "generation_tokens_total": self._num_generation_tokens,
            "healthy": self.engine.dead is None and not self._closed,
        }

    async def model_info(self) -> dict[str, Any]:
        cfg, mc = self.engine.config, self.engine.model_config
        return {
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "block_size": cfg.block_size,
            "num_device_blocks": self.engine.block_manager.num_device_blocks,
            "tensor_parallel_size": cfg.tensor_parallel_size,
        }

    async def shutdown(self) -> None:
        """End every open stream (finish_reason "abort"), stop stepping, free the workers and their PG."""
        if self._closed:
            return
        self._closed = True
        for request_id, stream in list(self._streams.items()):
            stream.group.error = "the engine controller shut down"
            self._abort(request_id)
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)  # ends: nothing left in flight
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        self._step_thread.shutdown(wait=False)
