"""ShardConfig: what a tensor-parallel rank needs to build and run its shard, decided once.

Built by `cluster.engine.resolve_config` from the user's config and the model, before any worker starts, and
passed whole to every rank (`ModelShard(source, model_config, config.shard, ...)`); nothing in it is `auto`
any more, except which of `attention_candidates` runs, the one thing only the rank's own process can answer.
Torch-free: the controller builds it, the torch-free worker carries it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from model_exec.config import ModelConfig
from ops.dtypes import DTYPES


@dataclass(frozen=True)
class DraftSpec:
    """Speculative decoding's draft model (`{"method": "draft_model", ...}`), read and checked against the
    target once (cluster/draft.py): rank 0 builds it beside its shard (model_exec/draft_model.py)."""

    model: str  # the path, as the speculative config gave it
    model_config: ModelConfig


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    device: Literal["cpu", "cuda"]  # `auto` resolved (cluster/device.py)
    dtype: str  # canonical name (ops.dtypes): float32 on CPU, the checkpoint's half type on CUDA, or as given
    attention_backend: str  # as named: a backend (checked against its row already) or `auto`
    # `auto`'s candidates by the backend table (ops/attention/registry.py) in order of preference, its fallback
    # last: the rank runs the first usable in its process. A named backend: itself alone.
    attention_candidates: tuple[str, ...]
    attention_passed_over: tuple[str, ...] = ()  # why auto passed over the table's other backends (its log line)
    block_size: int  # tokens per KV block; suits every candidate
    max_num_seqs: int  # sizes the CUDA graphs' buffers
    max_model_len: int  # sizes the CUDA graphs' block tables
    enforce_eager: bool = False  # CUDA: no decode graphs
    panel_gemm: bool = True  # CPU fp32: linear layers on the panel-packed GEMM
    quantization: str | None = None  # EngineConfig.quantization (model_exec/layers/quantization `select`)
    enable_lora: bool = False  # give the linear layers LoRA slots (adapters come later, Worker.add_lora)
    max_loras: int = 1
    max_lora_rank: int = 16
    runner: Literal["generate", "pooling"] = "generate"  # pooling: a pooling model and head, no sampler
    pooler_config: dict[str, Any] | None = None  # EngineConfig.pooler_config (model_exec/pooling_config.py)
    draft: DraftSpec | None = None  # speculative decoding with a draft model; None: none

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"ShardConfig.dtype must be a canonical dtype name ({', '.join(DTYPES)}); got {self.dtype!r}."
            )
        if not self.attention_candidates:
            raise ValueError("ShardConfig.attention_candidates must name at least one backend.")
