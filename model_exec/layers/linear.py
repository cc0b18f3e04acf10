"""Megatron-style tensor-parallel linear layers.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that
receives the FULL checkpoint tensor and copies only this rank's slice into the
parameter, so a rank never holds more than its shard plus one checkpoint tensor.
Parameters are allocated with `torch.empty` at their per-rank shape, in `params_dtype`
(default: torch's default dtype) on the caller's scoped device (see `models.build_model`).

Column-parallel layers split output features across ranks and never gather: their
output feeds an activation or attention that works per shard. Row-parallel layers
split input features and all-reduce the partial sums.

How the weight is held and multiplied is the layer's quantization method's (`layers.quantization`,
picked from the scope the model is built in): the layers here only cut each rank's rows and hand them to
`quant_method.load_rows`. Unquantized, after loading `pack_weights()` may move an fp32 CPU weight into a
faster layout (raytp's 16-wide panels by default, else oneDNN's blocked one; see `cpu_gemm`) and release
the dense copy; a GGUF checkpoint's weights stay in their blocks (`quantization.gguf`). Weights load
once, before packing.

LoRA (EngineConfig.enable_lora): `model_exec.lora.LoRAManager` attaches a `LoRASlots` as `lora` to the column-
and row-parallel layers; their forward then adds the step's adapters' products (row-parallel: to the rank's
partial sum, before the all-reduce, so LoRA adds no collective). Without LoRA `lora` stays None: one attribute
test per layer and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

import torch
from torch import nn

from model_exec.layers import cpu_gemm, quantization
from model_exec.layers.activation import SiluAndMul
from model_exec.layers.quantization import GGUFTensor, copy_shard
from model_exec.parallel import TPGroup

if TYPE_CHECKING:
    from model_exec.lora.slots import LoRASlots

# Shard id for a checkpoint tensor that already holds every matrix of a fused layer, stacked in the layer's
# order (Phi-3's qkv_proj and gate_up_proj): the loader splits it by the full sizes and cuts each rank's
# slice of each part, so every rank keeps [its q | its k | its v] as with separate tensors.
FUSED = "fused"


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None) -> None:
    """Loader for replicated parameters (norm weights): the whole tensor, on every rank."""
    copy_shard(param.data, loaded_weight)


@overload
def shard_of(full: torch.Tensor, dim: int, shard_size: int, tp: TPGroup) -> torch.Tensor: ...
@overload
def shard_of(full: GGUFTensor, dim: int, shard_size: int, tp: TPGroup) -> torch.Tensor | GGUFTensor: ...
@overload
def shard_of(full: torch.Tensor | GGUFTensor, dim: int, shard_size: int, tp: TPGroup) -> torch.Tensor | GGUFTensor: ...
def shard_of(full: torch.Tensor | GGUFTensor, dim: int, shard_size: int, tp: TPGroup) -> torch.Tensor | GGUFTensor:
    """This rank's slice of a full checkpoint tensor split evenly along `dim` (a view, no copy)."""
    if full.shape[dim] != shard_size * tp.world_size:
        raise ValueError(
            f"checkpoint tensor has {full.shape[dim]} entries along dim {dim}, "
            f"expected {shard_size} x {tp.world_size} ranks"
        )
    return full.narrow(dim, tp.rank * shard_size, shard_size)


def _set_loader(param: nn.Parameter | None, loader: object) -> None:
    if param is not None:
        param.weight_loader = loader  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.quant_method = quantization.linear_method()
        self.weight: nn.Parameter
        self.quant_method.create_weights(self, input_size, output_size, params_dtype)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None
        _set_loader(self.weight, self.weight_loader)
        _set_loader(self.bias, self.weight_loader)
        # The unquantized method sets at most one of these in pack_weights(); then `weight` holds no data.
        self.panel_weight: torch.Tensor | None = None  # cpu_gemm.pack_panels layout
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout
        self.lora: LoRASlots | None = None  # resident LoRA adapters (model_exec/lora), only with enable_lora

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        raise NotImplementedError

    def _store(self, param: nn.Parameter, offset: int, rows: torch.Tensor | GGUFTensor) -> None:
        """This rank's rows [offset, offset + len(rows)) of `param`: the weight's go to the quantization method."""
        if param is self.weight:
            self.quant_method.load_rows(self, offset, rows)
        else:
            copy_shard(param.data.narrow(0, offset, rows.shape[0]), rows)

    def pack_weights(self, panels: bool = True) -> bool:
        """After loading: the quantization method moves the weight into its compute layout (unquantized:
        panels when `panels`, EngineConfig.cpu_panel_gemm, or oneDNN's, when it can run there; see
        `cpu_gemm`); True if the layer now runs a packed or quantized kernel.

        A released parameter keeps its shape but becomes a zero-stride view of one element (no memory), so
        loading into it afterwards fails loudly instead of writing a matrix nobody reads.
        """
        return self.quant_method.process_weights_after_loading(self, panels)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        if param.shape[0] != loaded_weight.shape[0]:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter wants {tuple(param.shape)}"
            )
        self._store(param, 0, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W's rows (output features) split across ranks; output stays sharded."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp.world_size), bias, tp, params_dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        self._store(param, 0, shard_of(loaded_weight, 0, param.shape[0], self.tp))

    def output_parts(self) -> list[tuple[str | int | None, int, int]]:
        """(shard id, offset, size) of each matrix stacked in this rank's output rows, as `weight_loader`
        lays them out (a LoRA adapter's B is cut and placed the same way)."""
        return [(None, 0, self.weight.shape[0])]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one (gate/up); shard ids are their indices.

    Each rank's parameter is [rank's slice of matrix 0; rank's slice of matrix 1; ...],
    so the output splits into per-matrix halves locally.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = [divide(s, tp.world_size) for s in output_sizes]  # per rank
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id == FUSED:
            full_sizes = [s * self.tp.world_size for s in self.output_sizes]
            for i, part in enumerate(_split_fused(loaded_weight, full_sizes)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        self._store(param, offset, shard_of(loaded_weight, 0, size, self.tp))

    def output_parts(self) -> list[tuple[str | int | None, int, int]]:
        offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        return [(i, offset, size) for i, (offset, size) in enumerate(zip(offsets, self.output_sizes, strict=True))]


class GateUpParallelLinear(MergedColumnParallelLinear):
    """The gate and up projections of a gated MLP, fused ([gate; up] per rank), with their activation.

    `silu_and_mul(x)` is silu(x W_gate^T) * (x W_up^T): on the CPU panel path one kernel that never
    writes the [T, 2 * intermediate] product (`cpu_gemm.panel_linear_silu_mul`, the same bits as the
    two steps); elsewhere the projection, then `SiluAndMul`.
    """

    def __init__(
        self, input_size: int, intermediate_size: int, bias: bool, tp: TPGroup, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(input_size, [intermediate_size, intermediate_size], bias, tp, params_dtype)
        self._act = SiluAndMul()

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half = self.output_sizes[0]
        fused_ok = self.lora is None or not self.lora.active()  # the fused kernel has no room for a LoRA term
        if fused_ok and self.panel_weight is not None and self.bias is None and half % cpu_gemm.PANEL == 0:
            return cpu_gemm.panel_linear_silu_mul(x, self.panel_weight, half)
        return self._act(self.forward(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with attention heads split across ranks (shard ids "q", "k", "v").

    Each rank's output is [its q heads | its k heads | its v heads].
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.world_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp.world_size)
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias, tp, params_dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def output_parts(self) -> list[tuple[str | int | None, int, int]]:
        return [
            ("q", 0, self.q_size),
            ("k", self.q_size, self.kv_size),
            ("v", self.q_size + self.kv_size, self.kv_size),
        ]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id == FUSED:
            ws = self.tp.world_size
            parts = _split_fused(loaded_weight, [self.q_size * ws, self.kv_size * ws, self.kv_size * ws])
            for part_id, part in zip(("q", "k", "v"), parts, strict=True):
                self.weight_loader(param, part, part_id)
            return
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in offsets:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v' (or {FUSED!r}: all three), got {shard_id!r}")
        offset, size = offsets[str(shard_id)]
        self._store(param, offset, shard_of(loaded_weight, 0, size, self.tp))


def _split_fused(full: torch.Tensor | GGUFTensor, sizes: list[int]) -> tuple[torch.Tensor | GGUFTensor, ...]:
    """The parts of a fused checkpoint tensor along dim 0 (views), after checking it has exactly their rows."""
    if full.shape[0] != sum(sizes):
        raise ValueError(f"fused checkpoint tensor has {full.shape[0]} rows, its parts {sizes} need {sum(sizes)}")
    return full.split(sizes, dim=0)


class RowParallelLinear(LinearBase):
    """Y = X W^T with W's columns (input features) split; partial sums all-reduced.

    The bias is added once, after the reduce, so it is not counted world_size times. With
    `reduce_results=False` the layer returns this rank's partial sum and the caller reduces it together
    with others (a MoE layer's shared expert and routed experts: one all-reduce); it then has no bias.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer that leaves its all-reduce to the caller cannot add a bias")
        super().__init__(divide(input_size, tp.world_size), output_size, bias, tp, params_dtype)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_shard(param.data, loaded_weight)
            return
        if param.shape[0] != loaded_weight.shape[0]:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter wants {tuple(param.shape)}"
            )
        self._store(param, 0, shard_of(loaded_weight, 1, param.shape[1], self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.lora is not None:  # this rank's share of x A^T B^T: the all-reduce sums the shares
            self.lora.add_to(x, y)
        if not self.reduce_results:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
