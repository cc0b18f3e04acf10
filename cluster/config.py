"""EngineConfig: every knob of the engine, validated once, never mutated.

Names and defaults follow vLLM's engine arguments where they overlap, so
`LLM(...)` and the CLI flags read the same as vLLM's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from cluster.env import env_float
from model_exec.generation_config import check_generation_config_setting
from model_exec.shard_config import ShardConfig
from ops.attention.registry import ATTENTION_BACKENDS
from ops.dtypes import DTYPE_NAMES
from scheduler.config import PREEMPTION_MODES, PreemptionMode, SchedulerConfig, check_scheduler_fields
from scheduler.speculative import SpeculativeConfig

_GiB = 1 << 30
_DTYPES = ("auto", *DTYPE_NAMES)
# weight quantizations (model_exec/layers/quantization): gguf keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks on
# the CPU; int8 quantizes a float checkpoint's linear layers at load (CPU); fp8 runs FP8 linear layers on CUDA >= 8.9
# in bfloat16 (quantized at load, or a pre-quantized FP8 checkpoint); none loads every weight as floats (a GGUF
# dequantized: the reference the block kernels are checked against)
QUANTIZATIONS = ("fp8", "gguf", "int8", "none")
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")


def default_kv_cache_bytes() -> int:
    """The CPU KV budget when `kv_cache_memory_bytes` is not given: `RAYTP_CPU_KVCACHE_SPACE` GiB where set
    (vLLM's `VLLM_CPU_KVCACHE_SPACE`, the same unit), else a quarter of physical memory, at most 4 GiB.

    4 GiB is vLLM's CPU-backend default too; the pool is zero-filled at start, so more costs start-up time
    (seen: 4 GiB in 0.5 s on one machine, 5-6 s on another whose free memory was fragmented, where Linux
    compacts memory to give the pool huge pages; 1 GiB there: 0.13 s).
    """
    gib = env_float("RAYTP_CPU_KVCACHE_SPACE", 0.0)  # 0.0: unset (a set value must be positive)
    if gib:
        return int(gib * _GiB)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 * _GiB
    return int(min(total // 4, 4 * _GiB))


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with the help text (and choices) its command-line flag shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. The CLI builds one flag per field (`raytp.cli.args`), help text from the metadata."""

    model: str | None = _opt(None, "HF dir, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    revision: str | None = _opt(None, "hub revision of the model")
    trust_remote_code: bool = _opt(False, "accepted for vLLM compatibility; raytp never runs model code")
    generation_config: str = _opt(
        "auto",
        "sampling defaults for requests that leave them unset: auto (the model's generation_config.json), "
        "vllm (raytp's built-in defaults) or a folder holding a generation_config.json",
    )
    dtype: str = _opt("auto", "auto: float32 on CPU, the checkpoint's half type on CUDA", _DTYPES)
    device: str = _opt("auto", "auto: cuda when available, else cpu", ("auto", "cpu", "cuda"))
    seed: int = _opt(0, "seed of the engine RNG, which draws a seed for every request that has none")
    max_model_len: int | None = _opt(None, "longest prompt + output (default: the model's)")
    block_size: int | None = _opt(
        None, "tokens per KV block, a power of two (default: 128 on CPU, as vLLM's CPU backend; 16 on CUDA)"
    )
    max_num_seqs: int = _opt(256, "sequences (batch rows) per step")
    max_num_batched_tokens: int | None = _opt(
        None, "tokens per step (default: 2048 with chunked prefill, else max_model_len)"
    )
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps")
    preemption_mode: PreemptionMode = _opt("auto", "how to preempt when KV blocks run out", PREEMPTION_MODES)
    num_gpu_blocks_override: int | None = _opt(None, "force the device KV pool size in blocks (any device)")
    swap_space: float = _opt(4.0, "GiB of CPU memory for swapped-out KV blocks")
    kv_cache_memory_bytes: int | None = _opt(None, "CPU KV cache budget in bytes (default: RAM/4, at most 4 GiB)")
    gpu_memory_utilization: float = _opt(0.9, "CUDA: fraction of GPU memory the engine may use")
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks (Ray worker actors) per model replica")
    distributed_executor_backend: Literal["ray", "inprocess"] | None = _opt(
        None, "default: inprocess at TP=1 offline, ray otherwise", ("ray", "inprocess")
    )
    placement_strategy: PlacementStrategy = _opt(
        "PACK", "Ray placement group strategy for the TP workers", PLACEMENT_STRATEGIES
    )
    attention_backend: str = _opt("auto", "paged attention kernel", ATTENTION_BACKENDS)
    enforce_eager: bool = _opt(
        False, "CUDA: run every step eagerly, without the decode CUDA graphs (one per batch-size bucket)"
    )
    cpu_panel_gemm: bool = _opt(
        True,
        "CPU fp32: run linear layers on raytp's panel-packed GEMM instead of oneDNN (~1.6x faster "
        "single-stream decode, about even for large batches; same bits whatever the batching)",
    )
    quantization: str | None = _opt(
        None,
        "weight quantization: default: a GGUF keeps its blocks where they run (CPU, float32), any other checkpoint "
        "its floats; none (float weights; a GGUF dequantized); gguf (a GGUF keeps its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
        "blocks on the CPU in float32; refused where it cannot run); int8 (weight-only, "
        "scales per 32 weights computed at load; CPU float32); fp8 (FP8 weights per channel and activations per "
        "token on CUDA compute capability >= 8.9, dtype bfloat16; a pre-quantized FP8 checkpoint selects it by itself)",
        QUANTIZATIONS,
    )
    enable_lora: bool = _opt(False, "serve LoRA adapters (PEFT checkpoints) on top of the base model")
    max_loras: int = _opt(1, "with enable_lora: most distinct adapters in one step's batch")
    max_lora_rank: int = _opt(16, "with enable_lora: the highest adapter rank accepted")
    async_scheduling: bool = _opt(
        False,
        "schedule each step while the previous one runs (vLLM's flag): sampled ids stay on the workers, output "
        "processing lags one step, outputs are unchanged (cluster/async_step.py)",
    )
    disable_log_stats: bool = _opt(False, "record no engine metrics (vLLM's flag; Ray Serve's own series remain)")
    runner: Literal["auto", "generate", "pooling"] = _opt(
        "auto",
        "generate (text) or pooling (embeddings, scores: one forward per request, no decode); auto: pooling for "
        "encoder and cross-encoder models, generate for the rest",
        RUNNERS,
    )
    pooler_config: dict[str, Any] | None = _opt(
        None,
        "runner pooling: override the pooling the model's files say, as JSON (vLLM's names: "
        '{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true})',
    )
    hf_overrides: dict[str, Any] | None = _opt(
        None,
        "fields laid over the model's config.json, as JSON (vLLM's): e.g. a Qwen3-Reranker scored by its yes/no "
        'logits: {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}',
    )
    speculative_config: dict[str, Any] | None = _opt(
        None,
        'speculative decoding, as JSON (vLLM\'s names): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} proposes tokens by prompt lookup; greedy and seeded '
        "outputs are unchanged (scheduler/speculative.py)",
    )

    def __post_init__(self) -> None:
        check_generation_config_setting(self.generation_config)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}."
            )
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        check_scheduler_fields(self)  # the scheduler's own rules; the two lengths may still be None here
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.distributed_executor_backend not in (None, "ray", "inprocess"):
            raise ValueError(
                f"distributed_executor_backend must be 'ray' or 'inprocess'; got {self.distributed_executor_backend!r}."
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}; got {self.placement_strategy!r}."
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}.")
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError(f"pooler_config must be a dict (JSON object), got {type(self.pooler_config).__name__}.")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict (JSON object), got {type(self.hf_overrides).__name__}.")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # a bad config is refused by name, here
            if self.async_scheduling:
                raise ValueError(
                    "speculative_config needs async_scheduling off: the asynchronous step plans step N+1 before "
                    "step N's accepted run is known (cluster/async_step.py)."
                )
            if self.runner == "pooling":
                raise ValueError("speculative_config applies to runner='generate' only.")
        if self.distributed_executor_backend == "inprocess" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend='inprocess' supports tensor_parallel_size=1 only.")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` read into the scheduler's form (ValueError naming a bad key or value)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)


@dataclass(frozen=True, kw_only=True)
class ResolvedEngineConfig(EngineConfig):
    """An EngineConfig whose model- and device-dependent defaults are decided: built once, by
    `cluster.engine.resolve_config`, before any worker starts; the engine, its executor and its workers
    run with it. None of these fields is None or `auto` (each must be given: no defaults)."""

    device: Literal["cpu", "cuda"] = field()
    dtype: str = field()  # canonical (ops.dtypes), never `auto`
    distributed_executor_backend: Literal["ray", "inprocess"] = field()  # decided: never None
    max_model_len: int = field()
    max_num_batched_tokens: int = field()
    block_size: int = field()
    runner: Literal["generate", "pooling"] = field()  # decided from the model when `auto`
    # What the ranks and the scheduler run with, taken from the fields above once, passed whole.
    shard: ShardConfig = field()
    scheduler: SchedulerConfig = field()
