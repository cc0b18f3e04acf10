"""EngineLoop: one model replica's engine on an asyncio event loop, streaming per request.

The loop owns the LLMEngine (scheduler, block manager, output processor, executor -> TP
worker actors). It runs in two homes, the same code in both:

- in a Serve replica's own process (`raytp.serve.replica.ModelReplica`: by default the ingress replica that serves
  HTTP, else an `LLMServer` replica), where each token reaches the request's stream through an
  asyncio.Queue, with no Ray message between engine and server;
- as the `EngineController` Ray actor (batch replicas, tests), where callers open one Ray stream per
  request:

    gen = controller.generate.options(num_returns="streaming").remote(rid, ids, params)

and receive the engine's `RequestDelta`s for that request (text already detokenized, stop strings
already applied: the engine's one output road); the last has finished=True. Closing the stream
early (the caller cancelled) aborts the request and frees its blocks.

Threading invariant: every scheduler/block-manager change (add, abort, schedule, update, fail)
happens on the one event loop thread that calls this object; only `engine.execute` (the workers'
forward pass) runs in the one step thread. So adds and aborts land between or during steps without
locks, and the scheduler already tolerates a request aborted while its step is in flight. The step loop runs only
while requests are in flight; the first new request restarts it.

LoRA adapters: the engine's own LoRA steps (`LLMEngine.add_lora_op` / `remove_lora_op`, the code the offline
engine runs too) run here with their rank calls in that same step thread, so a load runs between two steps,
never during one, and never blocks the event loop; the controller's record of them (`engine.loras`) changes
on the event loop, after the workers answered. The adapter's config is
checked on the event loop first (one small JSON file), so a bad path or rank is a fast LoRAError. Loads and
unloads of one id run one at a time; a request naming an adapter not loaded yet loads it first (vLLM's way).

Metrics: the controller records what it owns (queues, KV usage, prefix cache, preemptions) and what
it publishes (tokens, TTFT, ITL, finished requests) through `EngineTelemetry` into Ray's metrics
pipeline, on the event loop between steps; each rank records its own step time.

Decision: unless the config says `distributed_executor_backend="inprocess"`, the controller runs
even TP=1 through the Ray executor, so the model sits in a placed worker actor that holds the
GPU/CPU bundle, and the process hosting the loop needs no accelerator — and, importing no torch,
little memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import ray

from cluster.async_step import StepPipeline
from cluster.config import EngineConfig
from cluster.engine import EngineDeadError, LLMEngine, LoRAOp, make_executor
from cluster.engine_telemetry import EngineTelemetry
from cluster.loop_records import LoopStats, ModelInfo
from cluster.outputs import RequestDelta
from request.lora import LoRAError, LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from scheduler.outputs import SchedulerOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CONCURRENT_CALLS = 4096  # each open stream holds one actor call slot for its lifetime


class EngineLoop:
    def __init__(
        self,
        config: EngineConfig,
        replica: str | None = None,
        model_name: str | None = None,
        group_name: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        """Loads the model (blocking: call it off the event loop). Labels of this engine's metrics:
        `replica` (the Serve replica id; default: this actor's name, else its id) and `model_name`
        (the name clients use; default: the model's own). `group_name`: its Ray workers' placement group.
        `num_threads`: the torch threads of an in-process worker (a Serve replica: the CPUs it reserved)."""
        if config.distributed_executor_backend is None:
            config = dataclasses.replace(config, distributed_executor_backend="ray")
        # The executor blocks in ray.get, but only here (start-up, before any request) and on the step and
        # health threads, never on the event loop; so Ray's warning about blocking gets in async actors is noise.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        # The default factory unless a group is named (tests swap LLMEngine for one bound to a fake executor).
        factory = (
            {}
            if group_name is None and num_threads is None
            else {"executor_factory": functools.partial(make_executor, group_name=group_name, num_threads=num_threads)}
        )
        self.engine = LLMEngine(config, **factory)
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytp-step")
        if self.engine.pipeline is not None:  # async_scheduling: its steps run on this same thread
            self.engine.use_step_thread(self._step_thread)
        self._queues: dict[str, asyncio.Queue[RequestDelta]] = {}  # request id -> its stream's deltas
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._lora_ops: dict[int, asyncio.Event] = {}  # adapter id -> set when its load / unload in flight ends
        # Metrics are recorded here, on the event loop thread, where the scheduler and the stream of
        # deltas to every caller live (cluster/engine_telemetry.py); the workers record their step times.
        self._telemetry: EngineTelemetry | None = None
        if not config.disable_log_stats:
            ctx = ray.get_runtime_context()
            replica = replica or ctx.get_actor_name() or ctx.get_actor_id() or "local"
            self._telemetry = EngineTelemetry(self.engine, replica, model_name or self.engine.model_name)

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestDelta, None]:
        """Stream the request's deltas; the last has finished=True. A bad request raises RequestError here
        (LoRAError for an adapter that cannot be served); an adapter not loaded yet is loaded first."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # The request waits here for its grammar (compiled on the grammar thread), not in the step.
            await self.engine.structured.prepare(params.structured_outputs)
        if lora_request is not None:
            # Until the adapter is loaded when _add runs, with no await between: a remove that slipped in after
            # a load finished makes this load it again, never the engine on the event loop.
            while self.engine.loras.check(lora_request):
                await self.add_lora(lora_request)
        queue = self._add(request_id, prompt_token_ids, params, lora_request)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # the caller cancelled or closed the stream: free the request's blocks
                self._abort(request_id)
            self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None,
    ) -> asyncio.Queue[RequestDelta]:
        if self._closed:
            raise EngineDeadError("the controller is shut down")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        group = self.engine.add_request(
            request_id, {"prompt_token_ids": prompt_token_ids}, params, lora_request=lora_request
        )
        if self._telemetry is not None:
            self._telemetry.on_add(request_id, group.sampling_params, group.arrival_time)  # pooling: max_tokens=1
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        return queue

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._publish(self.engine.collect_finished())

    # ------------------------------------------------------------------ LoRA adapters
    async def add_lora(self, lora: LoRARequest) -> bool:
        """Load an adapter on every rank; False when that very adapter is already loaded. LoRAError naming it
        when LoRA is off or the adapter cannot be served; the engine keeps serving either way."""
        await self._wait_lora_op(lora.lora_int_id if isinstance(lora, LoRARequest) else None)
        return await self._lora_op(lora.lora_int_id, self.engine.add_lora_op(lora))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every rank; False when it is not loaded; LoRAError while requests use it."""
        await self._wait_lora_op(lora_int_id)
        return await self._lora_op(lora_int_id, self.engine.remove_lora_op(lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    async def _wait_lora_op(self, lora_int_id: int | None) -> None:
        self._check_serving()
        while lora_int_id is not None and (busy := self._lora_ops.get(lora_int_id)) is not None:
            await busy.wait()
        self._check_serving()

    async def _lora_op(self, lora_int_id: int, op: LoRAOp) -> bool:
        """Run a LoRA step of the engine (`LLMEngine.add_lora_op`, ...): its checks and its record on the event
        loop, its rank calls on the step thread, between two steps. A step that needs no rank call (a refusal, an
        adapter already loaded) ends here at once. Otherwise the rest runs as a task of its own, the one op on this
        adapter id until it ends; shielded, so a caller that goes away (a client disconnecting mid-load) cannot
        leave the ranks and the registry disagreeing."""
        try:
            first = next(op)
        except StopIteration as done:
            return bool(done.value)
        done_event = self._lora_ops[lora_int_id] = asyncio.Event()

        async def run() -> bool:
            try:
                call = first
                while True:
                    call = op.send(await self._on_workers(call))
            except StopIteration as done:
                return bool(done.value)
            finally:
                del self._lora_ops[lora_int_id]
                done_event.set()

        task = asyncio.get_running_loop().create_task(run())
        # Its error reaches the caller through the shield; if the caller left, it is retrieved here.
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return await asyncio.shield(task)

    async def _on_workers(self, call: Callable[[], T]) -> T:
        """Run a rank call in the step thread, between two steps. A failure other than the adapter's
        (LoRAError) is the engine's: every request in flight ends with it, as when a step fails."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._step_thread, call)
        except LoRAError:
            raise
        except Exception as e:
            self._on_engine_failure(e)
            raise

    def _check_serving(self) -> None:
        if self._closed:
            raise EngineDeadError("the controller is shut down")
        if self.engine.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.engine.dead}")

    # ------------------------------------------------------------------ step loop
    async def _step_loop(self) -> None:
        if self.engine.pipeline is not None:
            await self._pipelined_step_loop(self.engine.pipeline)
            return
        loop = asyncio.get_running_loop()
        while self.engine.has_unfinished_requests() and self.engine.dead is None:
            start = time.monotonic()
            so = self.engine.schedule()
            try:
                result = await loop.run_in_executor(self._step_thread, self.engine.execute, so)
            except Exception as e:
                self._on_engine_failure(e)
                return
            self._publish(self.engine.update(so, result), so, start)
            # Let queued adds/aborts and stream consumers run; an empty step (nothing schedulable) backs off.
            await asyncio.sleep(0 if not so.is_empty else 0.005)
        if self._telemetry is not None:  # nothing in flight: the gauges show the idle state
            self._telemetry.on_idle()

    async def _pipelined_step_loop(self, pipeline: StepPipeline) -> None:
        """async_scheduling: the next step is scheduled and launched before the last one's result is applied
        (cluster/async_step.py); the event loop awaits the step thread, so adds and aborts land meanwhile."""
        while self.engine.has_unfinished_requests() and self.engine.dead is None:
            start = time.monotonic()
            steps = pipeline.step()
            try:
                while True:
                    await asyncio.wrap_future(next(steps))
            except StopIteration as done:
                deltas: list[RequestDelta] = done.value
            except Exception as e:  # the pipeline already ended every request with the error
                self._on_engine_failure(e)
                return
            self._publish(deltas, pipeline.last_resolved, start)
            await asyncio.sleep(0 if pipeline.in_flight is not None else 0.005)
        if self._telemetry is not None:
            self._telemetry.on_idle()

    def _on_engine_failure(self, error: BaseException) -> None:
        """Every request in flight ends with the error (its final delta says which rank failed)."""
        if self.engine.dead is None:
            self.engine.fail(error)
            if self._telemetry is not None:
                self._telemetry.on_failure(error)
        self._publish(self.engine.collect_finished())

    def _publish(self, deltas: list[RequestDelta], so: SchedulerOutput | None = None, start: float = 0.0) -> None:
        """Hand `deltas` to their streams and record their metrics. With `so`: the deltas of the step
        that began at `start` (time.monotonic()); without: final deltas published between steps."""
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        if self._telemetry is not None:
            self._telemetry.on_publish(deltas, so, start)

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

    async def get_stats(self) -> LoopStats:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        return LoopStats(
            num_requests=len(self._queues),
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            num_free_device_blocks=bm.num_free_device_blocks,
            num_device_blocks=bm.num_device_blocks,
            num_free_cpu_blocks=bm.num_free_cpu_blocks,
            num_cpu_blocks=bm.num_cpu_blocks,
            kv_usage=bm.usage(),
            num_preemptions_recompute=sched.num_preemptions_recompute,
            num_preemptions_swap=sched.num_preemptions_swap,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens_total=sched.num_prompt_tokens,
            generation_tokens_total=sched.num_generation_tokens,
            healthy=self.engine.dead is None and not self._closed,
            pid=os.getpid(),
            grammar_worker_pid=self.engine.structured.compile_worker_pid,
            grammar_worker_restarts=self.engine.structured.compile_worker_restarts,
        )

    async def model_info(self) -> ModelInfo:
        cfg, mc = self.engine.config, self.engine.model_config
        return ModelInfo(
            model=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            quantization=self.engine.quantization,
            dtype=cfg.dtype,
            generation_defaults=dict(self.engine.generation_defaults),
            pooling_task=self.engine.pooling_task,
            block_size=cfg.block_size,
            num_device_blocks=self.engine.block_manager.num_device_blocks,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_lora=cfg.enable_lora,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
        )

    async def shutdown(self) -> None:
        """End every open stream (finish_reason "abort"), stop stepping, free the workers and their PG."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._queues):
            group = self.engine.scheduler.get_group(request_id)
            if group is not None:
                group.error = "the engine controller shut down"
            self._abort(request_id)
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)  # ends: nothing left in flight
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        self._step_thread.shutdown(wait=False)
        if self._telemetry is not None:
            self._telemetry.close()


# The same loop as a Ray actor: one per batch replica (raytp/batch/replica.py), and in tests.
EngineController = ray.remote(num_cpus=0, max_concurrency=MAX_CONCURRENT_CALLS)(EngineLoop)  # type: ignore[call-overload]
