"""Paged attention for the CPU with a C++ decode kernel: the CPU default when it builds.

Decode rows (one new token each) go to `cpu_kernels.paged_decode_attention`, which reads every
row's keys and values in place from the paged cache: no gather into a buffer padded to the
longest row, no mask, one pass over exactly the row's own context. Prefill chunks stay on the
torch backend's path (one SDPA call per row, a GEMM-shaped workload the kernel would not beat).

Measured on 2 shared cores, one layer of SmolLM2 shapes (9/3 heads, head_dim 64, fp32, block size
16), `python -m benchmarks.attention_bench --backend torch|cpu`, best of 5 rounds on a busy machine:
96 decode rows with contexts 16..1088 65 -> 10 ms, 64 rows x 512 6.6 -> 5.0 ms, 1 row x 300
0.17 -> 0.05 ms. In a 24-row offline decode window (benchmarks/step_profile.py) attention went
from 2.82 s to 1.11 s of self time per 30 steps.
"""

from __future__ import annotations

import torch

from ops.attention import cpu_kernels
from ops.attention.base import AttentionMetadata
from ops.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        n = query.shape[0]
        cpu_kernels.paged_decode_attention(
            query, key_cache, value_cache, meta.block_tables[:n], meta.seq_lens[:n], self.scale, out[:n]
        )
