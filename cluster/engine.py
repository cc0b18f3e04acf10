"""LLMEngine: the step loop — schedule, execute, update — and request admission.

One engine per model replica. It owns the tokenizer, the scheduler with its block
manager, and an executor that reaches the worker(s). Everything a user can get
wrong is checked in `add_request` (before anything is allocated), so a bad request
raises `ValueError` and the requests already in flight carry on untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

from cluster.config import EngineConfig
from cluster.executor import Executor, make_executor
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput
from kv import BlockManager
from model_exec.config import ModelConfig
from model_exec.weights import load_model_config, load_tokenizer, resolve_model
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

_DEFAULT_CHUNKED_BUDGET = 2048


class EngineDeadError(RuntimeError):
    """A worker failed; the engine cannot serve any more requests."""


def resolve_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """Fill the knobs whose defaults depend on the model."""
    max_model_len = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({max_model_len})."
            )
        max_model_len = config.max_model_len
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = _DEFAULT_CHUNKED_BUDGET if config.enable_chunked_prefill else max_model_len
    return dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=budget)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor_factory: Callable[[EngineConfig, ModelConfig], Executor] = make_executor,
        detokenize: bool = True,  # False: callers detokenize (the EngineController streams token ids)
    ) -> None:
        source = resolve_model(config.model, config.revision)
        self.model_config = load_model_config(source, config.trust_remote_code)
        self.model_config.check_tp(config.tensor_parallel_size)
        self.config = resolve_config(config, self.model_config)
        self.model_name = source.name
        self.tokenizer = load_tokenizer(source, config.trust_remote_code)
        self.executor = executor_factory(self.config, self.model_config)
        num_device_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        self.executor.init_cache(num_device_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(
            block_size=self.config.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        assert self.config.max_model_len is not None and self.config.max_num_batched_tokens is not None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.config.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
                preemption_mode=self.config.preemption_mode,
            ),
            self.block_manager,
            self.model_config.eos_token_ids,
        )
        self.output_processor = OutputProcessor(self.tokenizer if detokenize else None)
        self._rng = random.Random(self.config.seed)
        self.dead: BaseException | None = None
        logger.info(
            "engine ready: %s, %d device KV blocks of %d tokens, %d CPU swap blocks",
            self.model_name,
            num_device_blocks,
            self.config.block_size,
            num_cpu_blocks,
        )

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any] | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> SequenceGroup:
        """Validate and queue a request. Raises ValueError (naming the field) on bad input."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        text, token_ids = self._prompt_tokens(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty.")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}) (the vocabulary size).")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, longer than max_model_len ({self.max_model_len}) "
                f"allows (the prompt plus at least one generated token must fit)."
            )
        bad = [t for t in (*params.stop_token_ids, *(params.logit_bias or {})) if not 0 <= t < vocab]
        if bad:
            field = "stop_token_ids" if bad[0] in params.stop_token_ids else "logit_bias"
            raise ValueError(f"{field} contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return self.scheduler.add_request(request_id, text, token_ids, params, seed, arrival_time)

    def _prompt_tokens(self, prompt: str | dict[str, Any] | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("prompt dicts need a 'prompt' string or a 'prompt_token_ids' list.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.scheduler.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule, execute, update. Returns outputs of requests that changed."""
        so = self.schedule()
        try:
            result = self.execute(so)
        except Exception as e:
            self.fail(e)
            raise
        return [self.output_processor.make_output(g) for g in self.update(so, result)]

    # The phases are public so an async caller (the EngineController) can run `execute` in a thread
    # while its event loop adds and aborts requests: `execute` touches only the executor, never the
    # scheduler, so scheduler state only ever changes on the caller's own thread.
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run a scheduled step on the workers (an empty step runs nothing)."""
        if so.is_empty:
            return ModelRunnerOutput()
        return self.executor.execute_model(so)

    def update(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceGroup]:
        """Apply a step's result; returns the requests that changed (new tokens, or finished for any reason)."""
        groups = self.scheduler.update(so, result)
        self.output_processor.process(groups, self.scheduler)
        seen = {g.request_id for g in groups}
        groups += [g for g in self.scheduler.take_finished() if g.request_id not in seen]
        return groups

    def fail(self, error: BaseException) -> None:
        """A worker failed: every request in flight ends with the error; the engine refuses new work."""
        self.dead = error
        for group in list(self.scheduler.waiting + self.scheduler.running + self.scheduler.swapped):
            group.error = f"engine failure: {error}"
            for seq in group.live_seqs():
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ABORTED)

    def shutdown(self) -> None:
        self.executor.shutdown()
