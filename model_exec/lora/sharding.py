"""Cutting one adapter's matrices for one layer into this rank's tensor-parallel shard (as vLLM does).

- Column-parallel layers (qkv, gate_up): the input is whole on every rank, so A is replicated; B's rows are the
  layer's output features, so each stacked part's B rows are cut exactly like that part's base weight rows
  (this rank's q/k/v heads, its gate/up slice) and placed at the part's rows of this rank's output.
- Row-parallel layers (o_proj, down_proj): the input is split, so A is cut along its input columns like the
  base weight; B is replicated. The rank's x_r A_r^T B^T is added to its partial sum before the all-reduce,
  which then sums sum_r x_r A_r^T B^T = x A^T B^T: the LoRA term costs no collective of its own.

Every shape is checked against the base layer first; a mismatch is a LoRAError naming the adapter and module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_exec.layers import cpu_gemm
from model_exec.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear, shard_of
from model_exec.lora.checkpoint import ModulePair
from model_exec.lora.slots import LoRAWeights
from request.lora import LoRAError


@dataclass(frozen=True)
class Piece:
    """One PEFT module's matrices and the stacked parts of a raytp layer they cover."""

    hf_module: str  # the module's HF name, for messages
    part_ids: tuple[str | int | None, ...]  # shard ids of the layer's parts (one part, or all of a fused layer)
    pair: ModulePair


def _check_shape(t: torch.Tensor, want: tuple[int, int], what: str, where: str, piece: Piece, module: str) -> None:
    if tuple(t.shape) != want:
        raise LoRAError(
            f"{where}: {piece.hf_module}.{what} has shape {tuple(t.shape)}, but the model's {module} needs {want}"
        )


def column_weights(
    layer: ColumnParallelLinear, module: str, pieces: list[Piece], rank: int, scaling: float, where: str
) -> LoRAWeights:
    """One adapter on a column-parallel layer: A stacked over pieces, B block-diagonal (see slots.py)."""
    tp = layer.tp
    in_size = layer.weight.shape[1]
    parts = {sid: (offset, size) for sid, offset, size in layer.output_parts()}
    a_t = torch.zeros(in_size, rank * len(pieces), dtype=torch.float32)
    b_t = torch.zeros(rank * len(pieces), layer.weight.shape[0], dtype=torch.float32)
    for j, piece in enumerate(pieces):
        full_sizes = [parts[sid][1] * tp.world_size for sid in piece.part_ids]
        _check_shape(piece.pair.a, (rank, in_size), "lora_A", where, piece, module)
        _check_shape(piece.pair.b, (sum(full_sizes), rank), "lora_B", where, piece, module)
        cols = slice(j * rank, (j + 1) * rank)
        a_t[:, cols] = piece.pair.a.float().T
        for sid, b_part in zip(piece.part_ids, piece.pair.b.float().split(full_sizes), strict=True):
            offset, size = parts[sid]
            b_t[cols, offset : offset + size] = scaling * shard_of(b_part, 0, size, tp).T
    return _on_layer(layer, a_t, b_t)


def row_weights(
    layer: RowParallelLinear, module: str, piece: Piece, rank: int, scaling: float, where: str
) -> LoRAWeights:
    """One adapter on a row-parallel layer: this rank's columns of A, all of B."""
    in_rank, out_size = layer.weight.shape[1], layer.weight.shape[0]
    _check_shape(piece.pair.a, (rank, in_rank * layer.tp.world_size), "lora_A", where, piece, module)
    _check_shape(piece.pair.b, (out_size, rank), "lora_B", where, piece, module)
    a_t = shard_of(piece.pair.a.float(), 1, in_rank, layer.tp).T
    return _on_layer(layer, a_t, scaling * piece.pair.b.float().T)


def _on_layer(layer: LinearBase, a_t: torch.Tensor, b_t: torch.Tensor) -> LoRAWeights:
    """The layer's LoRAWeights from fp32 A^T and (sB)^T (the scaling applied in fp32): in the base weight's dtype
    and on its device, packed into panels where the base layer runs on the panel kernel."""
    width, out_features = b_t.shape
    if layer.panel_weight is not None:  # fp32 on the CPU, the kernel built
        a, b = cpu_gemm.pack_panels(a_t.T.contiguous()), cpu_gemm.pack_panels(b_t.T.contiguous())
        return LoRAWeights(a, b, width, out_features, panels=True)
    weight = layer.weight
    a, b = a_t.to(weight.device, weight.dtype).contiguous(), b_t.to(weight.device, weight.dtype).contiguous()
    return LoRAWeights(a, b, width, out_features, panels=False)
