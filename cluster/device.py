"""Which device the model will run on, decided where the engine is built (before any worker starts).

The workers resolve `device` for themselves (`model_exec.shard.resolve_device`); the engine needs the
answer earlier for the defaults that depend on it (the KV block size) and the Ray executor for the
resources its worker actors reserve. Both read it here so they never disagree.
"""

from __future__ import annotations

from cluster.config import EngineConfig

# KV block size (tokens) when `block_size` is not given. CPU: vLLM's CPU backend default; a decode
# row then reads each block's K (and V) as one 96 KB run (SmolLM2-135M) instead of 12 KB ones that the
# hardware prefetchers restart on: measured 1.3-1.9x faster decode attention over a 4 GiB pool (see
# cluster/config.py's block_size). CUDA: vLLM's GPU default.
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


def runs_on_cuda(config: EngineConfig) -> bool:
    """True when the model's ranks run on CUDA: `device` as given, or for `auto` whether a GPU is there
    (this process's for the in-process executor, the Ray cluster's for Ray workers)."""
    if config.device != "auto":
        return config.device == "cuda"
    if config.executor_backend == "inprocess":
        import torch

        return torch.cuda.is_available()
    import ray

    from cluster.ray_utils import ensure_ray

    ensure_ray()
    return bool(ray.cluster_resources().get("GPU", 0) >= 1)


def default_block_size(config: EngineConfig) -> int:
    return CUDA_BLOCK_SIZE if runs_on_cuda(config) else CPU_BLOCK_SIZE
