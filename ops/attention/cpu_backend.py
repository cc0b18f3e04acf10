"""Paged attention for the CPU with C++ decode and prefill kernels: the CPU default when they build.

Decode rows (one new token each) go to `cpu_kernels.paged_decode_attention`, which reads every
row's keys and values in place from the paged cache: no gather into a buffer padded to the
longest row, no mask, one pass over exactly the row's own context. Prefill rows go to
`cpu_kernels.paged_prefill_attention` (flash-style, causal, GQA groups sharing K/V reads, cached
context read in place) when the kernels are the AVX2 build and head_dim is a multiple of 8; else
they stay on the torch backend's path (one SDPA call per row). Prefill, `python -m
benchmarks.attention_bench --backend torch|cpu --block-size 128`, 2026-11-25 on a Zen 5: one
512-token prompt 3.49 -> 2.19 ms per layer, prompts of 50/200/400/512
6.49 -> 4.02 ms, 8 x 64 tokens 0.74 -> 0.38 ms, one 2048-token prompt 34.8 -> 33.9 ms with the
kernel's AVX2 job (~145 GFLOP/s at any length; torch's SDPA catches up only on long prompts). Its
AVX-512 job (head_dim 64 or 128, picked at run time where the CPU has AVX-512F), against the AVX2 job
in one run (RAYTP_CPU_NO_AVX512=1 for the latter): 512 tokens 2.07 -> 0.97 ms, 50/200/400/512
3.74 -> 1.79 ms, 2048 tokens 32.1 -> 13.8 ms (~350 GFLOP/s).

Measured on 2 shared cores, one layer of SmolLM2 shapes (9/3 heads, head_dim 64, fp32, block size
16), `python -m benchmarks.attention_bench --backend torch|cpu`, best of 5 rounds on a busy machine:
96 decode rows with contexts 16..1088 65 -> 10 ms, 64 rows x 512 6.6 -> 5.0 ms, 1 row x 300
0.17 -> 0.05 ms. In a 24-row offline decode window (benchmarks/step_profile.py) attention went
from 2.82 s to 1.11 s of self time per 30 steps.

Sliding-window and soft-capped layers (Mistral, Qwen2, Gemma 2) run in the same kernels: a windowed
row reads only the keys inside its window (decode enters the block holding the window's first key
part-way and never touches earlier blocks; prefill starts each work item's key tiles at its first
query's window), and the soft-cap is applied to the scores before the softmax. `python -m
benchmarks.attention_bench --backend cpu --threads 1 --cpu-time [--sliding-window 512]`, 2026-11-26
on a busy Zen 5 (thread CPU time, AVX-512 job, block size 16), full vs window 512: 16 decode rows at
context 4096 7.1 -> 0.38 ms, a 256-token chunk on 3840 cached tokens 14.7 -> 2.0 ms, one 2048-token
prompt 29.8 -> 13.5 ms (the torch path these layers used before: 14.7, 30.6, 118 ms). Layers
without either option cost what they did before the options existed (within 1-3%, the noise there).
Soft-capping (a tanh per score) adds about 10% to a decode and 10-15% to a prefill.
"""

from __future__ import annotations

import torch

from ops.attention import cpu_kernels
from ops.attention.base import AttentionMetadata, StepKV
from ops.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cpu_kernels.load_error()

    def _prepare(self) -> None:
        super()._prepare()
        # The prefill kernel is AVX2 code only (the portable build registers it but refuses to run).
        self._prefill_kernel = cpu_kernels.vectorized() and self.head_dim % 8 == 0

    def _decode(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata, out: torch.Tensor) -> None:
        n = query.shape[0]
        cpu_kernels.paged_decode_attention(
            query,
            kv.key_cache,
            kv.value_cache,
            meta.block_tables[:n],
            meta.seq_lens[:n],
            self.scale,
            out[:n],
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def _prefill(self, query: torch.Tensor, kv: StepKV, meta: AttentionMetadata, out: torch.Tensor) -> None:
        # forward() wrote this step's keys and values into the cache first, so the kernel reads every
        # key from there; the torch path (the reference) reads the new ones from `kv.key` / `kv.value`.
        if not self._prefill_kernel or query.dtype != torch.float32 or query.stride(2) != 1:
            super()._prefill(query, kv, meta, out)
            return
        cpu_kernels.paged_prefill_attention(
            query,
            kv.key_cache,
            kv.value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.num_decodes,
            self.scale,
            out,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
