"""Model classes by HF `architectures` name (the registry is model_exec/architectures.py), imported lazily."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from model_exec.architectures import ARCHITECTURES

if TYPE_CHECKING:
    from torch import nn

    from model_exec.config import ModelConfig
    from model_exec.parallel import TPGroup
    from ops.attention.base import AttentionBackend, AttentionMetadata


class CausalLM(Protocol):
    """What the model runner needs of a model (every class in the registry provides it)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def modules(self) -> Iterator[nn.Module]: ...


def supported_architectures() -> tuple[str, ...]:
    return tuple(ARCHITECTURES)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(arch.module), arch.class_name)


def build_model(
    config: ModelConfig,
    tp: TPGroup,
    attn_backend: type[AttentionBackend],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """Construct this rank's shard directly on `device` in `dtype` (default: config.dtype), unloaded.

    Parameters are allocated empty at their shard shapes; call `load_weights` next. The
    dtype travels explicitly through the config (torch's process-global default dtype is
    never touched); the device is scoped with torch's thread-local device context.
    """
    if dtype is not None:
        config = replace(config, dtype=str(dtype).removeprefix("torch."))
    cls = get_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, tp, attn_backend)
    model.eval()
    return model  # type: ignore[return-value]  # nn.Module subclasses satisfy CausalLM


def pack_weights(model: CausalLM, panels: bool = True) -> int:
    """After `load_weights`: let every layer that can move its weight into a faster layout for its
    device (on the CPU, fp32: raytp's panels when `panels` (EngineConfig.cpu_panel_gemm), else
    oneDNN's; see `layers.cpu_gemm`). Returns how many layers did. Weights cannot be loaded again
    afterwards."""
    from model_exec.layers import cpu_gemm
    from model_exec.layers.embedding import ParallelLMHead
    from model_exec.layers.linear import LinearBase
    from model_exec.layers.moe import FusedMoE
    from model_exec.layers.quantization.base import UnquantizedLinearMethod

    # A model of many-row steps (encoders) asks to keep its fp32 CPU linears dense for MKL (cpu_gemm)
    dense = getattr(model, "dense_cpu_gemm", False) and cpu_gemm.mkl_fast_paths()

    def stays_dense(m: object) -> bool:
        return (
            dense
            and isinstance(m, LinearBase)
            and type(m.quant_method) is UnquantizedLinearMethod
            and m.weight.device.type == "cpu"
        )

    packable = LinearBase | ParallelLMHead | FusedMoE
    layers = [m for m in model.modules() if isinstance(m, packable) and not stays_dense(m)]
    return sum(1 for m in layers if m.pack_weights(panels))
