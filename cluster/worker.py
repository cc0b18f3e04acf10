"""Worker: one tensor-parallel rank — a model shard, its KV cache, and a model runner.

The same class runs in-process (TP=1) and as a Ray actor (one per rank). Its public
methods are the whole protocol between the controller and a rank:
`load_model` -> `determine_num_blocks` -> `init_cache` -> `execute_model` per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from kv.cache_engine import CacheEngine
from model_exec.config import ModelConfig
from model_exec.model_runner import ModelRunner, profile_forward
from model_exec.models import build_model
from model_exec.parallel import TPGroup, init_tp_group
from model_exec.weights import iter_weights, resolve_model
from ops.attention import get_attn_backend
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but no CUDA device is visible.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPE_NAMES[config.dtype]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision GEMMs are slow and the reference (HF fp32) is exact
    ckpt = model_config.torch_dtype
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return CacheEngine.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = (
            model_config  # resolved once by the controller: parsing a GGUF header takes seconds
        )
        self.rank = rank
        self.world_size = world_size
        self.dist_init_method = dist_init_method
        self.device = resolve_device(config)
        self.tp: TPGroup | None = None
        self.runner: ModelRunner | None = None
        self.cache: CacheEngine | None = None
        self.cache_shape: CacheShape | None = None

    # ------------------------------------------------------------------ setup
    def load_model(self) -> None:
        """Build this rank's shard of the model on its device and stream its weights in."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size == 1:
            self.tp = TPGroup.single()
        else:
            assert self.dist_init_method is not None
            self.tp = init_tp_group(
                self.rank,
                self.world_size,
                self.dist_init_method,
                "nccl" if self.device.type == "cuda" else "gloo",
                timeout_s=120,
            )
        source = resolve_model(self.config.model, self.config.revision)
        model_config = self.model_config
        model_config.check_tp(self.world_size)
        dtype = resolve_dtype(self.config, model_config, self.device)
        attn_backend = get_attn_backend(
            self.config.attention_backend, self.device, dtype, self.config.block_size
        )
        model = build_model(model_config, self.tp, attn_backend, self.device, dtype)
        model.load_weights(iter_weights(source))
        self.runner = ModelRunner(
            model, self.tp, self.config.block_size, self.device, model_config.eos_token_ids
        )
        self.cache_shape = CacheShape(
            num_layers=model_config.num_hidden_layers,
            num_kv_heads=model_config.num_key_value_heads // self.world_size,
            head_dim=model_config.head_dim,
            block_size=self.config.block_size,
            dtype=dtype,
        )
        logger.info("rank %d loaded %s (%s, %s)", self.rank, source.name, dtype, self.device)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) this rank can hold; the controller takes the minimum over ranks."""
        assert self.cache_shape is not None
        per_block = self.cache_shape.bytes_per_block
        num_cpu = self.config.swap_space_bytes // per_block
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override, num_cpu
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block), num_cpu
        from cluster.config import default_kv_cache_bytes

        budget = self.config.kv_cache_memory_bytes or default_kv_cache_bytes()
        return max(budget // per_block, 1), num_cpu

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run the largest batch once; what gpu_memory_utilization leaves after the peak goes to KV blocks."""
        assert self.runner is not None and self.cache_shape is not None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_forward(
            self.runner, self._max_batched_tokens(), self.config.max_num_seqs, self._scratch_cache
        )
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_kv = int(total * self.config.gpu_memory_utilization) - peak
        torch.cuda.empty_cache()
        if free_for_kv < per_block:
            raise ValueError(
                f"no room for the KV cache: the profile run peaked at {peak / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens."
            )
        return free_for_kv // per_block

    def _scratch_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache_shape is not None
        s = self.cache_shape
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        return [
            (
                torch.zeros(shape, dtype=s.dtype, device=self.device),
                torch.zeros(shape, dtype=s.dtype, device=self.device),
            )
            for _ in range(s.num_layers)
        ]

    def _max_batched_tokens(self) -> int:
        assert self.config.max_num_batched_tokens is not None, "the engine resolves it before workers start"
        return self.config.max_num_batched_tokens

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        assert self.cache_shape is not None
        s = self.cache_shape
        self.cache = CacheEngine(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            block_size=s.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            dtype=s.dtype,
            device=self.device,
        )

    # ------------------------------------------------------------------ step
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's block moves, then run the batch. Only rank 0 returns an output."""
        assert self.runner is not None and self.cache is not None
        # Order matters: swap-out reads blocks that the same step may hand to others.
        if so.blocks_to_swap_out:
            self.cache.swap_out(so.blocks_to_swap_out)
        if so.blocks_to_swap_in:
            self.cache.swap_in(so.blocks_to_swap_in)
        if so.blocks_to_copy:
            self.cache.copy(so.blocks_to_copy)
        return self.runner.execute(so, self.cache.device_caches)

    def shutdown(self) -> None:
        if self.tp is not None:
            self.tp.destroy()
