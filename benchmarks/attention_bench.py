"""Micro-benchmark of one attention layer's forward (cache write + paged attention), ms per call.

SmolLM2-135M shapes: 9 query heads, 3 KV heads, head_dim 64. Cases: a decode batch of 64 rows at
context 512, a mixed batch (decodes plus prefill chunks), and pure prefills. `--compare-prefill`
also times the alternative that torch_backend rejected for prefill rows (all rows padded into one
batched SDPA call with a causal+length mask), to show why it was rejected.

    python -m benchmarks.attention_bench                      # from the repo root: torch on CPU, fp32
    python -m benchmarks.attention_bench --backend cpu        # the C++ decode and prefill kernels on CPU
    python -m benchmarks.attention_bench --device cuda --dtype float16 --backend auto --block-size 256
    python -m benchmarks.attention_bench --backend cpu --sliding-window 512   # a windowed layer (Mistral, Gemma 2)

The two long-context cases show what a sliding window saves: a windowed layer reads only the window.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops.attention import get_attn_backend
from ops.attention.base import AttentionBackend, AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def build_step(
    rows: list[tuple[int, int]], block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """rows: (cached tokens, new tokens) per row, decodes first. Blocks are shuffled over the pool."""
    g = torch.Generator().manual_seed(0)
    need = [math.ceil((c + n) / block_size) for c, n in rows]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for (cached, new), nb in zip(rows, need, strict=True):
        blocks, order = order[:nb], order[nb:]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    width = max(need)
    q_lens = [n for _, n in rows]
    seq_lens = [c + n for c, n in rows]
    num_tokens = sum(q_lens)
    cache_shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decodes=sum(1 for n in q_lens if n == 1),
    )
    return q, k, v, key_cache, value_cache, meta


def padded_prefill(
    backend: AttentionBackend, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """The rejected alternative for prefill rows: pad every row to max_query_len, one batched SDPA call."""
    num_rows, max_q, total = meta.num_seqs, meta.max_query_len, q.shape[0]
    bs = kc.shape[1]
    nb = -(-meta.max_seq_len // bs)
    keys = nb * bs
    ids = meta.block_tables[:, :nb].reshape(-1)
    k = kc.index_select(0, ids).view(num_rows, keys, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = vc.index_select(0, ids).view(num_rows, keys, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    row = torch.repeat_interleave(torch.arange(num_rows, device=q.device), q_lens, output_size=total)
    dst = row * max_q + torch.arange(total, device=q.device) - meta.query_start_loc[:-1].long()[row]
    qp = q.new_zeros(num_rows * max_q, NUM_HEADS, HEAD_DIM).index_copy_(0, dst, q)
    q_pos = (meta.seq_lens - q_lens).view(-1, 1) + torch.arange(max_q, device=q.device)
    k_pos = torch.arange(keys, device=q.device).view(1, 1, keys)
    mask = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < meta.seq_lens.view(-1, 1, 1))
    out = F.scaled_dot_product_attention(
        qp.view(num_rows, max_q, NUM_HEADS, HEAD_DIM).transpose(1, 2),
        k,
        v,
        attn_mask=mask.unsqueeze(1),
        scale=backend.scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM).index_select(0, dst)


def time_ms(
    fn: Callable[[], object],
    iters: int,
    device: torch.device,
    rounds: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best of `rounds` rounds of `iters` calls: robust to other processes sharing the cores."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (clock() - start) / iters * 1e3)
    return best


CASES: dict[str, list[tuple[int, int]]] = {
    "decode  1 row x ctx 300": [(299, 1)],
    "decode  64 rows x ctx 512": [(511, 1)] * 64,
    # the offline workload's shape: contexts spread from short to long, padded to the longest by a gather
    "decode  96 rows x ctx 16..1088 (ragged)": [(16 + (1072 * i) // 95, 1) for i in range(96)],
    "mixed   32 decodes@512 + chunks 256@256, 256@768": [(511, 1)] * 32 + [(256, 256), (768, 256)],
    "prefill 1 x 512": [(0, 512)],
    "prefill 1 x 2048": [(0, 2048)],
    "prefill 4 rows 50/200/400/512": [(0, 50), (0, 200), (0, 400), (0, 512)],
    "prefill 8 rows x 64": [(0, 64)] * 8,
    "prefill chunk 512 + 3 short chunks": [(0, 512), (0, 16), (100, 16), (300, 16)],
    "decode  16 rows x ctx 4096": [(4095, 1)] * 16,
    "prefill chunk 256 on ctx 3840": [(3840, 256)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5, help="calls per timing round (best of 5 rounds)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--compare-prefill", action="store_true", help="also time the padded-prefill alternative")
    parser.add_argument("--sliding-window", type=int, default=None, help="the layer's sliding window (tokens)")
    parser.add_argument("--soft-cap", type=float, default=None, help="the layer's attention logit soft-cap")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time, not wall time (needs --threads 1): comparable across runs on "
        "cores that other processes share, since time spent descheduled does not count",
    )
    args = parser.parse_args()
    if args.compare_prefill and (args.sliding_window is not None or args.soft_cap is not None):
        parser.error("--compare-prefill times full causal attention only (no --sliding-window / --soft-cap)")
    if args.cpu_time and (args.threads != 1 or args.device != "cpu"):
        parser.error("--cpu-time measures one CPU thread: use it with --threads 1 on the CPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    backend_cls = get_attn_backend(args.backend, device, dtype, args.block_size)
    backend = backend_cls(
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEAD_DIM**-0.5,
        sliding_window=args.sliding_window,
        logits_soft_cap=args.soft_cap,
    )
    print(
        f"backend={backend.name} device={device} dtype={args.dtype} block_size={args.block_size} "
        f"threads={torch.get_num_threads()} heads={NUM_HEADS}/{NUM_KV_HEADS} head_dim={HEAD_DIM} "
        f"sliding_window={args.sliding_window} soft_cap={args.soft_cap}"
    )
    for name, rows in CASES.items():
        if args.only is not None and args.only not in name:
            continue
        q, k, v, kc, vc, meta = build_step(rows, args.block_size, dtype, device)
        ms = time_ms(lambda: backend.forward(q, k, v, kc, vc, meta), args.iters, device, clock=clock)  # noqa: B023
        line = f"  {name:<52} {ms:8.2f} ms/call"
        if args.compare_prefill and meta.num_decodes == 0:
            ref = backend.forward(q, k, v, kc, vc, meta)
            torch.testing.assert_close(padded_prefill(backend, q, kc, vc, meta), ref, atol=1e-4, rtol=1e-3)
            padded = time_ms(lambda: padded_prefill(backend, q, kc, vc, meta), args.iters, device, clock=clock)  # noqa: B023
            line += f"   (padded batched prefill: {padded:.2f} ms)"
        print(line)


if __name__ == "__main__":
    main()
