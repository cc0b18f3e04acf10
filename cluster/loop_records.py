"""What an engine loop answers about itself: typed records, not dicts read by string keys.

`EngineLoop.model_info()` -> `ModelInfo` (what the front door needs to serve the model: limits, defaults,
the LoRA settings), `EngineLoop.get_stats()` -> `LoopStats` (the engine's counters now, for tests,
benchmarks and operators; the metrics pipeline records its own, cluster/engine_telemetry.py). Plain frozen
dataclasses of plain values: they cross Ray (actor calls, Serve handles) by pickle, and the HTTP layer reads
them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the model's own name (its source); clients may know it under a served name
    max_model_len: int  # longest prompt + output, as resolved
    vocab_size: int  # token ids a request may name are below it
    eos_token_ids: list[int]
    quantization: str  # what the weights run, as every rank decided at load: "fp8" | "gguf" | "int8" | "none"
    dtype: str  # the resolved weight/activation dtype ("float32", "bfloat16", ...; never "auto")
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields unset requests take
    pooling_task: str | None = None  # "embed" | "score" for a pooling engine (runner pooling); None: it generates
    block_size: int = 16  # tokens per KV block
    num_device_blocks: int = 0  # the device KV pool, in blocks (the minimum over ranks)
    tensor_parallel_size: int = 1
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass(frozen=True)
class LoopStats:
    num_requests: int  # open streams (requests the loop still answers)
    num_waiting: int  # scheduler queues
    num_running: int
    num_swapped: int
    num_free_device_blocks: int  # KV blocks
    num_device_blocks: int
    num_free_cpu_blocks: int
    num_cpu_blocks: int
    kv_usage: float  # used share of the device pool
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queries: int  # blocks looked up / found in the prefix cache
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int  # every token the engine sampled
    healthy: bool  # no worker failed and the loop is not shut down
    pid: int  # the process that hosts the engine (a replica that restarted has a new one)
    grammar_worker_pid: int | None  # the structured-output compile worker's process (cluster/structured_output.py)
    grammar_worker_restarts: int

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def idle(self) -> bool:
        """No request in flight and every device KV block free again (no block leaked)."""
        return self.num_requests == 0 and self.num_free_device_blocks == self.num_device_blocks
