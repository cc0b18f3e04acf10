"""LLMEngine: the step loop — schedule, execute, update — and request admission.

One engine per model replica. It owns the tokenizer, the scheduler with its block manager,
the output processor (the one road from tokens to `RequestDelta`s) and an executor that
reaches the worker(s). Everything a user can get wrong is checked once, in `add_request`,
before anything is allocated: a bad request raises `RequestError` naming the field and the
requests already in flight carry on untouched.

Torch-free: the engine resolves the model (config, tokenizer) without loading weights; only
the workers, behind the executor, import torch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import random
import weakref
from collections.abc import Callable, Generator, Iterable
from typing import Any, cast

from cluster.async_step import StepHandle, StepPipeline
from cluster.config import EngineConfig, ResolvedEngineConfig
from cluster.device import resolve_config
from cluster.draft import read_draft
from cluster.executor import Executor
from cluster.heap import freeze_startup_heap, thaw_heap
from cluster.lora_registry import LoadedAdapters
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestDelta
from cluster.pooling import (
    check_pooling_request,
    encode_truncated,
    pooling_num_blocks,
    served_pooling_task,
    truncate_ids,
    truncation_length,
)
from cluster.structured_output import GrammarMatcher, StructuredOutputManager
from kv import BlockManager
from model_exec.config import ModelConfig
from model_exec.generation_config import sampling_defaults
from model_exec.shard_config import DraftSpec
from model_exec.source import ModelSource, load_tokenizer, read_model_config, resolve_model
from request.check import RequestLimits, check_request
from request.errors import RequestError
from request.lora import NO_LORA, LoRAError, LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]
# A LoRA step: yields the calls it needs on the ranks, is sent their answers, returns whether it changed anything.
LoRAOp = Generator[Callable[[], Any], Any, bool]


class EngineDeadError(RuntimeError):
    """A worker failed; the engine cannot serve any more requests."""


def read_checked_model(config: EngineConfig) -> tuple[ModelSource, ModelConfig, DraftSpec | None]:
    """The model as the engine will run it (no weights read), and speculative decoding's draft model if any,
    refused (ValueError) when `tensor_parallel_size` cannot split its heads, its generation_config.json holds a
    value SamplingParams refuses or the draft does not fit it (cluster/draft.py): the one place those checks
    run, for the engine and for `raytp serve`'s check before it starts Ray."""
    source = resolve_model(config.model, config.revision)
    model_config = read_model_config(source, config.trust_remote_code, config.generation_config, config.hf_overrides)
    model_config.check_tp(config.tensor_parallel_size)
    sampling_defaults(source, config.generation_config)  # a bad generation_config.json, refused as early
    return source, model_config, read_draft(config, source, model_config)


def make_executor(
    config: ResolvedEngineConfig,
    model_config: ModelConfig,
    group_name: str | None = None,
    num_threads: int | None = None,
) -> Executor:
    """The in-process executor (TP=1 by default) or the Ray one; Ray is imported only when asked for.
    `group_name`: the Ray executor's placement group name (cluster/ray_executor.py). `num_threads`: the
    in-process worker's torch threads (None: torch's default; a Ray rank takes its bundle's CPUs)."""
    if config.distributed_executor_backend == "inprocess":
        from cluster.executor import InProcessExecutor

        return InProcessExecutor(config, model_config, num_threads=num_threads)
    from cluster.ray_executor import RayExecutor

    return RayExecutor(config, model_config, group_name)


def agreed_quantization(executor: Executor) -> str:
    """The quantization every rank runs ("fp8" | "gguf" | "int8" | "none"). Ranks that disagree (which only a
    difference between their nodes could cause) are refused, naming each rank's answer, and the executor shut
    down: one model replica runs one quantization, and its label must be true of every rank."""
    answers = executor.collective_rpc("quantization")
    if len(set(answers)) != 1:
        executor.shutdown()
        ranks = ", ".join(f"rank {r}: {q}" for r, q in enumerate(answers))
        raise RuntimeError(f"the tensor-parallel ranks loaded the weights with different quantizations ({ranks}).")
    return str(answers[0])


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[ResolvedEngineConfig, ModelConfig], Executor] = make_executor,
    ) -> None:
        source, self.model_config, draft = read_checked_model(config)
        self.config = resolve_config(config, self.model_config, draft)
        self.model_name = source.name
        # SamplingParams fields a request leaves unset take these (offline: LLM.get_default_sampling_params)
        self.generation_defaults = sampling_defaults(source, config.generation_config)
        if self.generation_defaults:
            logger.warning(
                "sampling defaults taken from the model's generation config: %s; requests that set a field "
                "override it (start with --generation-config vllm to use raytp's own defaults)",
                ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items()),
            )
        self.tokenizer = load_tokenizer(source, config.trust_remote_code)
        self.executor = executor_factory(self.config, self.model_config)
        # What the weights run, as the ranks decided it at load (a pre-quantized checkpoint can pick fp8 with the
        # setting unset; a GGUF without quantization='gguf' runs "none"): /v1/models and the metrics name it.
        self.quantization = agreed_quantization(self.executor)
        sizes = self.executor.collective_rpc("determine_num_blocks")  # every rank's; the smallest fits them all
        num_device_blocks, num_cpu_blocks = min(d for d, _ in sizes), min(c for _, c in sizes)
        # pooling_task: what a pooling engine serves ("embed" | "score"); None when it generates
        self.pooling_task: str | None = None
        if self.config.runner == "pooling":
            self.pooling_task = served_pooling_task(self.model_config.architecture)
            num_device_blocks = pooling_num_blocks(
                num_device_blocks, self.config.max_num_batched_tokens, self.config.max_num_seqs, self.config.block_size
            )
            num_cpu_blocks = 0  # a pooling request lives one step: never preempted, never swapped
        self.executor.collective_rpc("init_cache", num_device_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(
            block_size=self.config.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, self.model_config.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_prompt_tokens=self.block_manager.max_allocatable_tokens,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.loras = LoadedAdapters(self.config.enable_lora, self.config.max_lora_rank)
        self._rng = random.Random(self.config.seed)
        self.dead: BaseException | None = None
        # async_scheduling: steps run one step ahead of the host (cluster/async_step.py), launched in place where
        # the executor can (the in-process one on CUDA), else on one worker-call thread.
        self._step_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.pipeline: StepPipeline | None = None
        self._own_step_pool = self.config.async_scheduling
        self._launcher = self.executor.step_launcher() if self.config.async_scheduling else None
        if self._launcher is not None:
            self.pipeline = StepPipeline(self, self._launcher)
        elif self.config.async_scheduling:
            self.use_step_thread(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytp-exec"))
        freeze_startup_heap()  # the step's collections walk only what the steps allocate (cluster/heap.py)
        weakref.finalize(self, thaw_heap)  # an engine dropped without shutdown() (offline LLM) thaws it too
        logger.info(
            "engine ready: %s (%s, quantization %s), %d device KV blocks of %d tokens, %d CPU swap blocks",
            self.model_name,
            self.config.dtype,
            self.quantization,
            num_device_blocks,
            self.config.block_size,
            num_cpu_blocks,
        )

    def use_step_thread(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        """Run the asynchronous step's worker calls on `pool` (one thread: steps stay in order). The serving
        loop passes its own step thread, where its LoRA loads run too, so they never run beside a step.
        Steps launched in place stay so unless LoRA is on: the serving loop's LoRA calls run on `pool`, and
        only one thread may reach the ranks."""
        if self._launcher is not None and not self.config.enable_lora:
            return
        previous, owned = self._step_pool, self._own_step_pool
        self._step_pool, self._own_step_pool = pool, previous is pool and owned
        self.pipeline = StepPipeline(self, lambda so: StepHandle.of_future(pool.submit(self.execute, so)))
        if previous is not None and previous is not pool and owned:
            previous.shutdown(wait=True)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> SequenceGroup:
        """Check and queue a request: SamplingParams on a generating engine, PoolingParams (an embedding, a
        score) on a pooling one. Raises RequestError (naming the field) on bad input, EngineDeadError
        once a worker failed. An adapter not loaded yet is loaded here first, blocking on the workers, as
        vLLM's LLM.generate does (the serving loop loads it on its step thread before calling this)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if isinstance(params, PoolingParams) or self.pooling_task is not None:
            return self._add_pooling_request(request_id, prompt, params, arrival_time, lora_request)
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        text, token_ids = self._prompt_tokens(prompt)
        check_request(token_ids, params, self.limits)
        lora_id, lora_generation = NO_LORA, 0
        if lora_request is not None:
            self.add_lora(lora_request)
            lora_id, lora_generation = lora_request.lora_int_id, self.loras.generation(lora_request.lora_int_id)
        # Compiles here unless cached: the serving loop awaits `structured.prepare` first, so only offline
        # callers can wait here, and they have no step running.
        spec = params.structured_outputs
        constraint = self.structured.matcher(spec) if spec is not None else None
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        group = self.scheduler.add_request(
            request_id, text, token_ids, params, seed, arrival_time, constraint, lora_id, lora_generation
        )
        self.output_processor.add_request(group)
        return group

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None,
        lora_request: LoRARequest | None,
    ) -> SequenceGroup:
        """One forward over the prompt, pooled (cluster/pooling.py); the refusals name why."""
        if self.pooling_task is None:
            raise RequestError(
                f"model {self.model_name!r} runs generation: it does not serve embeddings or scores (start it "
                "with runner='pooling' to pool its hidden states).",
                "model",
            )
        if not isinstance(params, PoolingParams):
            raise RequestError(
                f"model {self.model_name!r} is served for {'embeddings' if self.pooling_task == 'embed' else 'scores'}"
                " (runner='pooling'): it does not generate text.",
                "model",
            )
        if lora_request is not None:
            raise RequestError("LoRA adapters are not supported by the pooling runner.", "lora_request")
        keep = truncation_length(params.truncate_prompt_tokens, self.limits.max_model_len)
        text_only = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        text: str | None
        if keep is not None and isinstance(text_only, str):
            text, token_ids = text_only, encode_truncated(self.tokenizer, text_only, keep)  # the tokenizer cuts text
        else:
            text, token_ids = self._prompt_tokens(prompt)
            token_ids = truncate_ids(token_ids, keep)
        check_pooling_request(token_ids, params, self.limits, self.pooling_task, self.model_config.hidden_size)
        group = self.scheduler.add_request(
            request_id, text, token_ids, SamplingParams(max_tokens=1), 0, arrival_time, pooling_params=params
        )
        self.output_processor.add_request(group)
        return group

    def _prompt_tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise RequestError("prompt_token_ids must be a list of integers.", "prompt")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise RequestError("prompt dicts need a 'prompt' string or a 'prompt_token_ids' list.", "prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise RequestError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.", "prompt"
        )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End requests wherever they are and free their blocks; their final deltas come from
        `collect_finished` (or the next `step`). Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        in_flight = self.pipeline is not None and self.pipeline.in_flight is not None
        return self.scheduler.has_unfinished_requests() or self.output_processor.num_requests > 0 or in_flight

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # ------------------------------------------------------------------ LoRA adapters
    # Each LoRA step is written once, as a generator: what it does with the controller's record runs in the
    # caller's thread, and each call it needs on the ranks is yielded for the caller to run where rank calls
    # run: inline here (`run_lora_op`), on the step thread between two steps in the serving loop
    # (cluster/controller.py). Either way the rank call's answer is sent back into the step.
    def add_lora_op(self, lora: LoRARequest) -> LoRAOp:
        """Load an adapter on every rank, then record it; False when that very adapter is already loaded.
        LoRAError (naming it) when LoRA is off or its config is bad (checked before any rank is touched)."""
        if not self.loras.check(lora):
            return False
        yield functools.partial(self._load_on_ranks, lora)
        self.loras.register(lora)
        return True

    def remove_lora_op(self, lora_int_id: int) -> LoRAOp:
        """Unload an adapter from every rank; False when it is not loaded. Decision: refused (LoRAError naming
        it and the count) while unfinished requests use it, rather than deferred: the caller learns at once, and
        no request ever loses its adapter mid-way. Its cached KV blocks age out of the prefix cache (LRU)."""
        if self.check_lora_removal(lora_int_id) is None:
            return False
        # Forgotten first: a request naming it from now on loads it again, after this unload.
        self.loras.unregister(lora_int_id)
        yield functools.partial(self.executor.collective_rpc, "remove_lora", lora_int_id)
        return True

    def _load_on_ranks(self, lora: LoRARequest) -> None:
        try:
            self.executor.collective_rpc("add_lora", lora)
        except LoRAError:
            # Some ranks may have loaded it: every rank must hold the same adapters, so they drop it again.
            self.executor.collective_rpc("remove_lora", lora.lora_int_id)
            raise

    def run_lora_op(self, op: LoRAOp) -> bool:
        """Run a LoRA step here, its rank calls inline (blocking on the workers). A rank's LoRAError is the
        adapter's fault and reaches the caller as itself; any other failure is the engine's (`fail`)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        try:
            call = next(op)
            while True:
                if self.pipeline is not None:
                    self.pipeline.wait_idle()  # the ranks never load or unload beside a step in flight
                try:
                    answer = call()
                except LoRAError:
                    raise
                except Exception as e:
                    self.fail(e)
                    raise
                call = op.send(answer)
        except StopIteration as done:
            return bool(done.value)

    def add_lora(self, lora: LoRARequest) -> bool:
        """vLLM's `LLMEngine.add_lora`: `add_lora_op`, run here."""
        return self.run_lora_op(self.add_lora_op(lora))

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's `LLMEngine.remove_lora`: `remove_lora_op`, run here."""
        return self.run_lora_op(self.remove_lora_op(lora_int_id))

    def check_lora_removal(self, lora_int_id: int) -> LoRARequest | None:
        """The adapter that `remove_lora` would unload (None: not loaded); LoRAError while requests use it."""
        lora = self.loras.get(lora_int_id)
        if lora is None:
            return None
        in_use = self.scheduler.num_requests_with_lora(lora_int_id)
        if in_use:
            raise LoRAError(
                f"LoRA adapter {lora.lora_name!r} (lora_int_id {lora_int_id}) is in use by {in_use} unfinished "
                f"request{'s' if in_use > 1 else ''}: wait for them to finish or abort them, then remove it.",
                "lora_int_id",
                "lora_in_use",
            )
        return lora

    def list_loras(self) -> list[LoRARequest]:
        """The adapters every rank holds, by id."""
        return self.loras.list()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestDelta]:
        """One engine iteration: schedule, execute, update. Returns the deltas of requests that changed.
        With async_scheduling: schedule and launch the next step, then apply the one before it."""
        if self.pipeline is not None:
            return self.pipeline.run_blocking()
        so = self.schedule()
        try:
            result = self.execute(so)
        except Exception as e:
            self.fail(e)  # every request in flight ends with the error; the caller sees it raised
            raise
        return self.update(so, result)

    # The phases are public so an async caller (the EngineController) can run `execute` in a thread
    # while its event loop adds and aborts requests: `execute` touches only the executor, never the
    # scheduler, so scheduler state only ever changes on the caller's own thread.
    def schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        if so.structured_seq_ids:  # unconstrained steps pay nothing
            # Every constraint the scheduler holds was made by self.structured, as a GrammarMatcher.
            matchers = cast(list[GrammarMatcher], [self.scheduler.constraint_of(i) for i in so.structured_seq_ids])
            so.grammar_bitmask = self.structured.fill_bitmask(matchers)
        return so

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run a scheduled step on the workers (an empty step runs nothing)."""
        if so.is_empty:
            return ModelRunnerOutput()
        return self.executor.execute_model(so)

    def update(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestDelta]:
        """Apply a step's result: new tokens -> deltas. A stop string ends its sequence here, at once."""
        return self.emit(self.scheduler.update(so, result)) + self.collect_finished()

    def emit(self, groups: list[SequenceGroup]) -> list[RequestDelta]:
        """The deltas of requests that got tokens; a stop string ends its sequence here, at once."""
        deltas, stopped = self.output_processor.process(groups)
        for seq, stop in stopped:
            self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=stop)
        return deltas

    def collect_finished(self) -> list[RequestDelta]:
        """Final deltas of requests that ended outside a step's tokens (aborted, refused, failed)."""
        return self.output_processor.process(self.scheduler.take_finished())[0]

    def fail(self, error: BaseException) -> None:
        """A worker failed: every request in flight ends with the error; the engine refuses new work."""
        logger.error("engine step failed: %s", error)
        self.dead = error
        for group in list(self.scheduler.waiting + self.scheduler.running + self.scheduler.swapped):
            group.error = f"engine failure: {error}"
            for seq in group.live_seqs():
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.wait_idle()
        if self._step_pool is not None and self._own_step_pool:
            self._step_pool.shutdown(wait=True)
        self.structured.shutdown()
        self.executor.shutdown()
        thaw_heap()
