"""A linear layer's resident adapters, and the batched LoRA product it adds to its output.

Decision: every adapter of a layer is ONE pair of matrices on this rank, whatever the layer stacks.
A fused column-parallel layer (qkv: q, k, v; gate_up: gate, up) gets A = the parts' A matrices stacked
([sum of ranks, in]) and B = [out_rank, sum of ranks], block-diagonal: each part's B rows (this rank's shard of
them) sit at the part's rows of the layer's output, in the columns of its own A; a part the adapter does not
target is zero there. So one layer, one adapter costs two small GEMMs, not one per part; the zeros cost
(parts - 1) x rank x out multiply-adds per token, small next to the base GEMM at LoRA ranks.
The adapter's scaling (alpha / r) is folded into B when it loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_exec.layers import cpu_gemm
from model_exec.lora.context import LoRAContext


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's matrices on one layer of this rank: A (column-parallel: over the whole input; row-parallel:
    this rank's cut of it) and scaling x B (column-parallel: this rank's rows; row-parallel: all of them).

    Dense (`panels` False): a = A^T [in, width], b = (sB)^T [width, out], for `x @ a @ b`. Panels (True: the base
    layer runs on raytp's CPU panel GEMM, `layers/cpu_gemm.py`): a = A and b = sB packed by `pack_panels`, run by
    the same kernel; measured on a 64-row SmolLM2 decode step with 4 adapters of rank 16 it takes the LoRA
    products' time from ~35 to ~17 ms (MKL runs these 16-row GEMMs at a fraction of the panel kernel's rate).
    """

    a: torch.Tensor
    b: torch.Tensor
    width: int  # A's rows: the adapter's rank x the parts it stacks
    out_features: int  # B's rows: the layer's output features on this rank
    panels: bool

    def add_product(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += x A^T (sB)^T, in place (x [n, in], y [n, out], views of the step's tensors)."""
        if self.panels:
            xa = cpu_gemm.panel_linear(x, self.a, self.width, None)
            y.add_(cpu_gemm.panel_linear(xa, self.b, self.out_features, None))
        else:
            y.addmm_(x @ self.a, self.b)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


class LoRASlots:
    """Attached as `linear.lora` to each LoRA-capable layer when LoRA is enabled (`LoRAManager`)."""

    def __init__(self, name: str, context: LoRAContext) -> None:
        self.name = name  # the module's name in the model (model.layers.3.self_attn.qkv_proj)
        self.context = context  # shared by every layer of the rank: the running step's token groups
        self.adapters: dict[int, LoRAWeights] = {}  # lora_int_id -> its weights here (absent: not targeted)

    def active(self) -> bool:
        """Whether this step runs any adapter that targets this layer."""
        step = self.context.step
        return step is not None and any(lora_id in self.adapters for lora_id in step.lora_ids)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[tokens of adapter i] += x[those tokens] A_i^T B_i^T for each adapter i in the step, in place.

        One pass per adapter and token range (at most two ranges per adapter: decodes, then prefills),
        never per token; the ranges are contiguous, so x and y are sliced as views (no gather, no scatter).
        """
        step = self.context.step
        if step is None:
            return
        for lora_id, ranges in step.groups:
            w = self.adapters.get(lora_id)
            if w is None:
                continue
            for start, stop in ranges:
                w.add_product(x[start:stop], y[start:stop])
