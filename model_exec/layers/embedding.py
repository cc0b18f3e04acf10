"""Vocabulary-parallel token embedding and LM head.

Rank r owns vocabulary rows [r * shard, (r + 1) * shard), shard = ceil(vocab / world).
The last rank's tail past `vocab_size` is zero padding, so every rank's shard has
the same shape (needed by `gather`) and padded logits are cut off after gathering.

GGUF blocks (built in a `quantization` scope that keeps them, `GGUFConfig`): a vocabulary matrix of a kernel
type stays in its blocks (`gguf_weight`, padding rows all-zero bytes, i.e. zero scales): lookups dequantize
only the rows asked for, and the LM head (tied or not) multiplies with the blocks (`ops/csrc/gguf_gemm.cpp`).
With `quantization="int8"` the LM head multiplies with a Q8_0 copy made at packing (`quantization.int8`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_exec.layers import cpu_gemm, quantization
from model_exec.layers.quantization import row_roads
from model_exec.layers.quantization.base import copy_shard, release
from model_exec.layers.quantization.gguf import decode_pack, gguf_linear, kernels_available
from model_exec.layers.quantization.gguf_tensor import BLOCK, Q8_0, GGUFTensor, dequantize_rows
from model_exec.layers.quantization.int8 import quantize_q8_0
from model_exec.parallel import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
        shared_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // tp.world_size)
        self.vocab_start = tp.rank * self.shard_size
        # rows of the real vocabulary this rank holds (the rest of its shard is padding)
        self.num_real_rows = max(0, min(self.shard_size, num_embeddings - self.vocab_start))
        if shared_weight is None:
            self.weight = nn.Parameter(
                torch.empty(self.shard_size, embedding_dim, dtype=params_dtype), requires_grad=False
            )
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        elif shared_weight.shape != (self.shard_size, embedding_dim):
            raise ValueError(
                f"shared weight has shape {tuple(shared_weight.shape)}, expected {(self.shard_size, embedding_dim)}"
            )
        else:
            self.weight = shared_weight  # loaded through its owner
        config = quantization.current()
        self._keep_blocks = config is not None and config.keeps_gguf_blocks()
        self._int8 = config is not None and config.name == "int8"  # the LM head quantizes its copy at packing
        # (GGML type, this rank's rows in block layout) when kept in blocks; `weight` then holds no data
        self.gguf_weight: tuple[int, torch.Tensor] | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | GGUFTensor, shard_id: str | int | None = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"embedding checkpoint has {loaded_weight.shape[0]} rows, config says vocab_size={self.num_embeddings}"
            )
        n = self.num_real_rows
        if isinstance(loaded_weight, GGUFTensor) and self._keep_blocks and kernels_available():
            if loaded_weight.shape[1] != param.shape[1]:
                raise ValueError(
                    f"embedding checkpoint has shape {tuple(loaded_weight.shape)}, wants {tuple(param.shape)}"
                )
            raw = torch.zeros(self.shard_size, loaded_weight.raw.shape[1], dtype=torch.uint8)
            raw[:n].copy_(loaded_weight.raw.narrow(0, self.vocab_start, n))
            self.gguf_weight = (loaded_weight.qtype, raw)
            release(param)
            return
        copy_shard(param.data[:n], loaded_weight.narrow(0, self.vocab_start, n))
        param.data[n:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_weight is None:
            return F.embedding(ids, self.weight)
        qtype, raw = self.gguf_weight
        flat = ids.reshape(-1)
        rows = dequantize_rows(raw.index_select(0, flat), qtype, self.weight.shape[1])
        return rows.view(*ids.shape, self.weight.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits, gathered on rank 0.

    With `tied_to`, the head shares the embedding's (identically sharded) weight and
    has no parameter of its own to load.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        shared = None if tied_to is None else tied_to.weight
        super().__init__(num_embeddings, embedding_dim, tp, params_dtype, shared)
        self.tied = tied_to is not None
        # a tied head multiplies with its embedding's GGUF blocks when it keeps them (set past nn.Module's
        # registry: the embedding is the model's child, not the head's)
        object.__setattr__(self, "_tied_to", tied_to)
        self._tied_to: VocabParallelEmbedding | None
        # At most one of these is set, by pack_weights(): compute_logits' copy of the weight.
        self.panel_weight: torch.Tensor | None = None  # cpu_gemm.pack_panels layout
        self.packed_weight: torch.Tensor | None = None  # oneDNN's layout
        self.gguf_packed: torch.Tensor | None = None  # GGUF blocks' integer-road copy (`gguf.decode_pack`)

    def pack_weights(self, panels: bool = True) -> bool:
        """Give compute_logits a packed copy of the weight (panels when `panels`, else oneDNN's
        layout, see `cpu_gemm`) when it can run there; True if it did.

        A tied head leaves the embedding its dense weight (token lookup needs it), so packing costs one
        more copy of the vocabulary matrix (113 MB for SmolLM2-135M); it halves the head's time at
        batch 64 on 2 cores. An untied head releases its dense weight, as linear layers do.
        """
        if self.panel_weight is not None or self.packed_weight is not None or self.gguf_packed is not None:
            return True
        if self._tied_to is not None and self._tied_to.gguf_weight is not None:
            self.gguf_weight = self._tied_to.gguf_weight  # the same blocks, no copy
        elif self.gguf_weight is None and self._int8 and self.weight.shape[1] % BLOCK == 0 and kernels_available():
            # int8: the head's own Q8_0 copy (a tied embedding keeps its floats for lookups, as with panels)
            self.gguf_weight = (Q8_0, quantize_q8_0(self.weight.data))
            if not self.tied:
                release(self.weight)
        if self.gguf_weight is not None:
            # the integer road's copy (a tied head's lookups keep reading the embedding's blocks)
            self.gguf_packed = decode_pack(self.gguf_weight[1], self.gguf_weight[0])
            return True
        copies = cpu_gemm.pack(self.weight, panels)
        if copies is None:
            return False
        self.panel_weight, self.packed_weight = copies
        if not self.tied:
            self.weight.data = torch.empty(1, dtype=self.weight.dtype).expand(self.weight.shape)
        return True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab_size] on rank 0; None on other ranks."""
        if self.gguf_weight is not None:  # every row on the integer tiles: a row's logits never follow its neighbours'
            qtype, raw = self.gguf_weight
            local = gguf_linear(hidden, raw, qtype, self.gguf_packed, row_roads.INTEGER)
        else:
            local = cpu_gemm.linear(hidden, self.weight, self.panel_weight, self.packed_weight, None)
        gathered = self.tp.gather(local, dim=-1)
        return None if gathered is None else gathered[..., : self.num_embeddings]
