"""ModelShard: everything one tensor-parallel rank does with tensors.

Its model shard (built on the device, weights streamed in), its KV cache (`CacheEngine`) and its
model runner. `cluster.worker.Worker` (the rank's protocol, in-process or as a Ray actor) creates
one in `load_model`; keeping the tensors here keeps the worker module, and so the controller that
starts the worker actors, free of torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from model_exec import malloc_tuning
from model_exec.cache_engine import CacheEngine
from model_exec.config import ModelConfig
from model_exec.cuda_graphs import DecodeGraphs, capture_sizes
from model_exec.draft_model import DraftModel
from model_exec.kv_sizing import MemorySnapshot, measure_kv_budget, take_snapshot
from model_exec.layers.quantization import scope as quantization_scope
from model_exec.layers.quantization.select import select_quantization
from model_exec.lora.manager import LoRAManager
from model_exec.model_runner import ModelRunner, profile_forward
from model_exec.models import CausalLM, build_model, pack_weights
from model_exec.models.loading import CheckpointLoader
from model_exec.parallel import TPGroup, init_tp_group
from model_exec.pooler import Pooler
from model_exec.pooling_model import build_pooling_model
from model_exec.shard_config import DraftSpec, ShardConfig
from model_exec.source import ModelSource, resolve_model
from model_exec.step_launch import LaunchedStep
from model_exec.warmup import warm_up_decode
from model_exec.weights import iter_weights
from ops.attention import get_attn_backend, pick_backend
from ops.attention.base import AttentionBackend
from ops.dtypes import torch_dtype
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def torch_device(device: Literal["cpu", "cuda"]) -> torch.device:
    """The torch device of a device the engine already decided (`auto` is resolved once, before any worker
    starts: cluster/device.py), here where the worker runs."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but no CUDA device is visible.")
    return torch.device("cuda", torch.cuda.current_device())


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


class ModelShard:
    def __init__(
        self,
        source: ModelSource,
        model_config: ModelConfig,
        config: ShardConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dist_init_method: str | None = None,
    ) -> None:
        """Join the TP group, build this rank's shard on its device and stream its weights in, as `config` (decided
        once by the engine, cluster/device.py `resolve_config`) says. With enable_lora the linear layers get LoRA
        slots (adapters are added later, `Worker.add_lora`); without it the model is exactly the base model.
        config.quantization: EngineConfig.quantization (`layers.quantization.select`)."""
        self.config = config
        device, block_size = config.device, config.block_size
        self.device = torch_device(device)
        self._mem_at_start: MemorySnapshot | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            # Before the TP group and the weights: NCCL's buffers and the weights count as this rank's.
            self._mem_at_start = take_snapshot(torch.cuda, self.device)
        elif malloc_tuning.enabled():  # every step's activations come from malloc: keep them off fresh pages
            malloc_tuning.keep_freed_memory()
        if world_size == 1:
            self.tp = TPGroup.single()
        else:
            assert dist_init_method is not None
            backend: Literal["gloo", "nccl"] = "nccl" if self.device.type == "cuda" else "gloo"
            self.tp = init_tp_group(rank, world_size, dist_init_method, backend, timeout_s=120)
        dtype = torch_dtype(config.dtype)
        if config.attention_backend == "auto":
            attn_backend = pick_backend(config.attention_candidates, self.device, config.attention_passed_over)
        else:
            attn_backend = get_attn_backend(config.attention_backend, self.device, dtype, block_size)
        quant = select_quantization(
            config.quantization, source.kind, self.device, dtype, model_config.hf.get("quantization_config")
        )
        self.quantization = "none" if quant is None else quant.name
        pooler: Pooler | None = None
        with quantization_scope(quant):
            if config.runner == "pooling":
                model, pooler = build_pooling_model(
                    source, model_config, self.tp, attn_backend, self.device, dtype, config.pooler_config
                )
            else:
                model = build_model(model_config, self.tp, attn_backend, self.device, dtype)
        weights = iter_weights(source, keep_gguf_blocks=quant is not None and quant.keeps_gguf_blocks())
        # GGUFTensors stand in for tensors through every loader (layers.quantization.gguf_tensor)
        model.load_weights(weights)  # type: ignore[arg-type]
        pack_weights(model, panels=config.panel_gemm)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            assert isinstance(model, CheckpointLoader)  # every registered family is one
            self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank)
        self.runner = ModelRunner(
            model, self.tp, block_size, self.device, model_config.eos_token_ids, self.lora, pooler
        )
        # Speculative decoding's draft: whole, on rank 0 only, unquantized, its KV pool beside the target's
        # (model_exec/draft_model.py); its weights count as loaded before the CUDA memory snapshot below.
        self.draft_shape: CacheShape | None = None
        if config.draft is not None and self.tp.rank == 0:
            self.runner.draft = DraftModel(self._load_draft(config.draft, attn_backend, dtype))
            d = config.draft.model_config
            self.draft_shape = CacheShape(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, block_size, dtype)
        self._mem_after_load = take_snapshot(torch.cuda, self.device) if self.device.type == "cuda" else None
        self.use_cuda_graphs = self._decide_cuda_graphs(attn_backend.cuda_graph_capturable, config.enforce_eager)
        self.cache_shape = CacheShape(
            num_layers=model_config.num_hidden_layers,
            num_kv_heads=model_config.num_key_value_heads // world_size,
            head_dim=model_config.head_dim,
            block_size=block_size,
            dtype=dtype,
        )
        self.cache: CacheEngine | None = None
        self.draft_cache: CacheEngine | None = None  # rank 0 with a draft model
        logger.info(
            "rank %d loaded %s (%s, %s, quantization %s)",
            rank,
            source.name,
            dtype,
            self.device,
            self.quantization,
        )

    def _load_draft(self, draft: DraftSpec, attn_backend: type[AttentionBackend], dtype: torch.dtype) -> CausalLM:
        source = resolve_model(draft.model)
        model = build_model(draft.model_config, TPGroup.single(), attn_backend, self.device, dtype)
        model.load_weights(iter_weights(source))  # type: ignore[arg-type]  # no GGUF blocks: plain tensors only
        pack_weights(model, panels=self.config.panel_gemm)
        logger.info("rank %d loaded the draft model %s", self.tp.rank, source.name)
        return model

    @property
    def bytes_per_block(self) -> int:
        """One block id's bytes on this rank: the target's KV, and on rank 0 the draft's beside it."""
        draft = self.draft_shape.bytes_per_block if self.draft_shape is not None else 0
        return self.cache_shape.bytes_per_block + draft

    def _decide_cuda_graphs(self, capturable: bool, enforce_eager: bool) -> bool:
        if self.device.type != "cuda":
            return False
        if enforce_eager:
            logger.info("decode runs eagerly: enforce_eager is set")
            return False
        if not capturable:
            logger.info("decode runs eagerly: the attention backend cannot be captured into CUDA graphs")
            return False
        if self.lora is not None:
            # Decision: a graph would freeze one step's adapter groups; LoRA engines run every step eagerly.
            logger.info("decode runs eagerly: CUDA graphs are not captured with enable_lora")
            return False
        if self.tp.world_size > 1:
            # Decision: NCCL all-reduces inside captured graphs have not run on this road yet; TP stays eager.
            logger.info("decode runs eagerly: CUDA graphs are used at tensor_parallel_size=1 only")
            return False
        return True

    def profile_cuda_blocks(self, max_batched_tokens: int, max_num_seqs: int, gpu_memory_utilization: float) -> int:
        """KV blocks this rank can hold (model_exec/kv_sizing.py): device memory measured at start, after
        loading and after the largest step with a sampler pass over max_num_seqs rows. With CUDA graphs one
        block of that is the pad block, so one fewer is offered."""
        assert self._mem_at_start is not None and self._mem_after_load is not None, "CUDA ranks only"
        budget = measure_kv_budget(
            torch.cuda,
            self.device,
            self._mem_at_start,
            self._mem_after_load,
            lambda: profile_forward(self.runner, max_batched_tokens, max_num_seqs, self._scratch_cache),
            gpu_memory_utilization=gpu_memory_utilization,
            bytes_per_block=self.bytes_per_block,
        )
        logger.info("rank %d %s", self.tp.rank, budget.describe())
        return budget.num_blocks - int(self.use_cuda_graphs)

    def _scratch_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.cache_shape
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        return [
            (
                torch.zeros(shape, dtype=s.dtype, device=self.device),
                torch.zeros(shape, dtype=s.dtype, device=self.device),
            )
            for _ in range(s.num_layers)
        ]

    def _cache_engine(self, s: CacheShape, num_device_blocks: int, num_cpu_blocks: int, pad: bool) -> CacheEngine:
        return CacheEngine(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            block_size=s.block_size,
            num_device_blocks=num_device_blocks,
            num_cpu_blocks=num_cpu_blocks,
            dtype=s.dtype,
            device=self.device,
            pad_block=pad,
        )

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        s = self.cache_shape
        self.cache = self._cache_engine(s, num_device_blocks, num_cpu_blocks, self.use_cuda_graphs)
        if self.runner.draft is not None:
            assert self.draft_shape is not None
            # the same block ids as the target's pool: the draft runs eagerly, so it has no pad block
            self.draft_cache = self._cache_engine(self.draft_shape, num_device_blocks, num_cpu_blocks, False)
            self.runner.draft.kv_caches = self.draft_cache.device_caches
        if self.use_cuda_graphs:
            assert self.cache.pad_block_id is not None
            graphs = DecodeGraphs(
                self.runner.model,
                self.cache.device_caches,
                sizes=capture_sizes(self.config.max_num_seqs),
                max_model_len=self.config.max_model_len,
                block_size=s.block_size,
                pad_block=self.cache.pad_block_id,
                device=self.device,
            )
            try:
                graphs.capture()
            except Exception as exc:  # a backend that cannot be captured after all: serve, eagerly, and say why
                logger.warning("decode runs eagerly: capturing CUDA graphs failed (%s: %s)", type(exc).__name__, exc)
                self.use_cuda_graphs = False
                torch.cuda.synchronize()
            else:
                self.runner.attach_decode_graphs(graphs)
        if self.device.type == "cuda" and self.config.runner != "pooling":
            # Before the first request: block 0 holds nothing yet (model_exec/warmup.py).
            warm_up_decode(
                self.runner.model, self.cache.device_caches, s.block_size, self.config.max_model_len, self.device
            )
            if self.runner.draft is not None and self.draft_cache is not None:  # the draft's decodes, warm too
                warm_up_decode(
                    self.runner.draft.model,
                    self.draft_cache.device_caches,
                    s.block_size,
                    self.config.max_model_len,
                    self.device,
                )

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's block moves, then run the batch. Only rank 0 returns an output."""
        assert self.cache is not None, "init_cache first"
        self._move_blocks(so)
        return self.runner.execute(so, self.cache.device_caches)

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """`execute` in two halves (model_exec/step_launch.py): the block moves and the step are enqueued;
        the returned step's `resolve` gives the output."""
        assert self.cache is not None, "init_cache first"
        self._move_blocks(so)
        return self.runner.launch(so, self.cache.device_caches)

    def _move_blocks(self, so: SchedulerOutput) -> None:
        # Order matters: swap-out reads blocks that the same step may hand to others.
        for cache in (self.cache, self.draft_cache):  # one block id names a block in both pools
            if cache is None:
                continue
            if so.blocks_to_swap_out:
                cache.swap_out(so.blocks_to_swap_out)
            if so.blocks_to_swap_in:
                cache.swap_in(so.blocks_to_swap_in)
            if so.blocks_to_copy:
                cache.copy(so.blocks_to_copy)

    def shutdown(self) -> None:
        self.tp.destroy()
