"""Which device the model will run on, decided once where the engine is built (before any worker starts).

`resolve_config` turns `device="auto"` into "cpu" or "cuda" here, so the defaults that depend on it
(the KV block size), the resources the Ray executor reserves and the device each worker loads onto
all follow one answer.
"""

from __future__ import annotations

from typing import Literal

from cluster.config import EngineConfig
from ops.attention import FLASH_ATTN_BLOCK_MULTIPLE, flash_attn_error

# KV block size (tokens) when `block_size` is not given. CPU: vLLM's CPU backend default; a decode
# row then reads each block's K (and V) as one 96 KB run (SmolLM2-135M) instead of 12 KB ones, and the
# hardware prefetchers restart less often. Measured: `python -m benchmarks.step_profile --profile torch
# --profile-steps 100 100 --block-size 16|128` (offline workload, 32 prompts), decode attention 3.54 ->
# 2.87 s in the window (medians of 2 alternating rounds, GEMM unchanged); random blocks of a 2 GiB pool,
# 64 rows x 512 tokens, 2 threads: 4.2-4.7 -> 2.2-3.0 ms per call. CUDA: vLLM's GPU default.
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


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


def default_block_size(device: Literal["cpu", "cuda"], attention_backend: str = "auto", dtype: str = "auto") -> int:
    """The KV block size when none is given, chosen with the attention backend it must suit.

    CUDA: flash-attn's smallest block size where `flash_attn` is asked for, or where `auto` will pick
    it (the package imports and the dtype is half precision, as `dtype="auto"` always is on CUDA); else 16, with
    which `auto` picks triton (any block size). Under Ray this runs on the driver: if its flash-attn
    differs from the workers', the workers' `auto` still finds a backend that pages that size in place
    (flash_attn or triton at 256, triton at 16)."""
    if device == "cpu":
        return CPU_BLOCK_SIZE
    if attention_backend == "flash_attn":
        return FLASH_ATTN_BLOCK_MULTIPLE
    if attention_backend == "auto" and dtype not in ("float32", "float") and flash_attn_error() is None:
        return FLASH_ATTN_BLOCK_MULTIPLE
    return CUDA_BLOCK_SIZE
