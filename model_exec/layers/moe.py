"""Mixture-of-experts MLP: the router's top-k choice and the experts' stacked, tensor-parallel weights.

Each expert is a gated MLP (silu(x W_gate^T) * x W_up^T) W_down^T, sharded over TP ranks like a
column-parallel gate/up and a row-parallel down projection: every rank holds every expert's slice of
the intermediate dimension, so routing is replicated, no token moves between ranks, and one
all-reduce after the weighted sum finishes the layer (the caller may take it unreduced to share that
all-reduce with a shared expert, Qwen2-MoE).

Parameters (HF transformers 5's in-memory names and layouts, so a checkpoint with stacked expert
tensors loads as is):
    gate_up_proj  [E, 2 * I / tp, H]   per expert [its gate slice; its up slice]
    down_proj     [E, H, I / tp]

The forward groups tokens by expert (one stable sort of the T * top_k choices) and runs one GEMM pair
per expert that received tokens, over that expert's rows only: the Python loop is over experts, never
tokens. A padded batched matmul (the rows padded per expert into [E, max_rows, H], `torch.bmm` over
all experts) was measured against the same loop with F.linear (`python -m benchmarks.moe_layer
--threads 1`, Mixtral-like shapes, min ms at 1 / 16 / 256 tokens): loop 8.0 / 97 / 325, bmm 34 / 95 /
363. bmm reads every expert's weights even when only top_k have rows (a decode step) and pays for the
padding when the load is uneven; it ties at best, so the loop stays.

On the CPU in fp32, `pack_weights` moves each expert into raytp's 16-wide panels (`cpu_gemm`), as the
dense layers do: the gate/up product and SiLU-and-mul run as one kernel, and a row's result does not
depend on which other rows share its expert (the panel kernel's per-row FMA order). Same benchmark:
2.2 / 17.5 / 123 ms, against transformers' default (grouped_mm) 7.7 / 97 / 316.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_exec import huge_pages
from model_exec.layers import cpu_gemm
from model_exec.layers.activation import SiluAndMul
from model_exec.layers.linear import ReplicatedLinear, divide, shard_of
from model_exec.layers.quantization.base import copy_shard
from model_exec.parallel import TPGroup

# the checkpoint part a per-expert tensor is, by its HF name (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj)
EXPERT_PARTS = ("gate", "up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E].

    Softmax over all experts in float32, then the top_k probabilities; `renormalize` rescales them to sum
    to one (Mixtral always; Qwen2/3-MoE when `norm_topk_prob`). HF's routers, operation for operation.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs with stacked weights; forward(x, router_logits) -> [T, H]."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        if intermediate_size % tp.world_size:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} is not divisible by "
                f"tensor_parallel_size={tp.world_size}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = divide(intermediate_size, tp.world_size)  # per rank
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.tp = tp
        i = self.intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * i, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i, dtype=params_dtype), requires_grad=False)
        for p in (self.gate_up_proj, self.down_proj):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._act = SiluAndMul()
        # set together by pack_weights(): per expert, cpu_gemm.pack_panels layouts; the parameters then hold no data
        self.gate_up_panels: torch.Tensor | None = None  # [E, ceil(2I/16), H, 16]
        self.down_panels: torch.Tensor | None = None  # [E, ceil(H/16), I, 16]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Load one expert's full checkpoint matrix; shard_id = (expert, "gate" | "up" | "down")."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PARTS):
            raise ValueError(f"expert shard_id must be (expert, one of {EXPERT_PARTS}), got {shard_id!r}")
        expert, part = shard_id
        if not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert!r} out of range for {self.num_experts} experts")
        i = self.intermediate_size
        if part == "down":
            if param is not self.down_proj:
                raise ValueError("an expert's down projection loads into down_proj")
            copy_shard(param.data[expert], shard_of(loaded_weight, 1, i, self.tp))
            return
        if param is not self.gate_up_proj:
            raise ValueError(f"an expert's {part} projection loads into gate_up_proj")
        offset = 0 if part == "gate" else i
        copy_shard(param.data[expert].narrow(0, offset, i), shard_of(loaded_weight, 0, i, self.tp))

    def pack_weights(self, panels: bool = True) -> bool:
        """Move every expert into cpu_gemm's panel layout when `panels` and the kernel can run it; True if
        it did. Without panels the experts stay dense (F.linear): oneDNN's opaque packed tensors cannot be
        stacked or sliced per expert."""
        if self.gate_up_panels is not None:
            return True
        if not (panels and cpu_gemm.can_use_panels(self.gate_up_proj[0])):
            return False
        self.gate_up_panels = _stack_panels(self.gate_up_proj.data)
        self.down_panels = _stack_panels(self.down_proj.data)
        for p in (self.gate_up_proj, self.down_proj):  # loading again would fail loudly, as in LinearBase
            p.data = torch.empty(1, dtype=p.dtype).expand(p.shape)
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        return self.tp.all_reduce(out) if self.reduce_results else out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t (this rank's partial sum)."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the T * top_k choices, grouped by expert
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, token)
        out_rows = torch.empty(num_tokens * top_k, self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out_rows[start : start + n] = self._expert(e, rows[start : start + n])
                start += n
        # HF weights the expert outputs in the activations' dtype (Qwen MoE casts; Mixtral's float32 weights
        # differ from this only below the activations' precision)
        out_rows.mul_(weights.reshape(-1)[order].to(x.dtype).unsqueeze(1))
        # index_add_ adds in row order, so each token sums its experts in ascending id order from zero,
        # as HF's loop over experts does
        return torch.zeros_like(x).index_add_(0, token, out_rows)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        i = self.intermediate_size
        if self.gate_up_panels is not None and self.down_panels is not None:
            if i % cpu_gemm.PANEL == 0:
                h = cpu_gemm.panel_linear_silu_mul(x, self.gate_up_panels[e], i)
            else:
                h = self._act(cpu_gemm.panel_linear(x, self.gate_up_panels[e], 2 * i, None))
            return cpu_gemm.panel_linear(h, self.down_panels[e], self.hidden_size, None)
        return F.linear(self._act(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])


class SparseMoeBlock(nn.Module):
    """A MoE MLP: the `experts` and their router `gate` (replicated: every rank routes every token alike),
    sized and typed from the experts.

    forward(x) -> [T, H], all-reduced unless the experts' `reduce_results` is False (then this rank's partial sum).
    """

    def __init__(self, experts: FusedMoE) -> None:
        super().__init__()
        dtype = experts.gate_up_proj.dtype
        self.gate = ReplicatedLinear(experts.hidden_size, experts.num_experts, False, experts.tp, dtype)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def _stack_panels(weights: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> [E, ceil(out / 16), in, 16]: each expert in `cpu_gemm.pack_panels`' layout (16 output
    features side by side per input feature, the last panel zero-padded), written straight into one
    tensor advised onto huge pages before the copies touch it (every decode step streams its rows)."""
    num_experts, out_features, in_features = weights.shape
    groups = -(-out_features // cpu_gemm.PANEL)
    stacked = torch.empty(num_experts, groups, in_features, cpu_gemm.PANEL, dtype=weights.dtype)
    huge_pages.advise(stacked)
    for e in range(num_experts):
        padded = F.pad(weights[e], (0, 0, 0, groups * cpu_gemm.PANEL - out_features))
        stacked[e].copy_(padded.view(groups, cpu_gemm.PANEL, in_features).transpose(1, 2))
    return stacked
