"""A decoder layer's elementwise steps, the layers' torch code vs the fused CPU kernels (ops/fused.py).

    python -m benchmarks.fused_layers_bench [--tokens 1 16 64 512] [--threads 2]

SmolLM2-135M shapes (hidden 576, 9 query / 3 KV heads of 64, intermediate 1536), fp32, under
inference mode. Each step goes through the layer's `forward` (fused where it applies) and its
`forward_torch` / `rotate` (the reference); prints the best per-call time of `--rounds` rounds of
`--reps` calls. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from model_exec.layers.activation import SiluAndMul
from model_exec.layers.norm import RMSNorm
from model_exec.layers.rotary import RotaryEmbedding
from ops import fused

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def best_us(fn: Callable[[], object], reps: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return 1e6 * min(times)


def steps(tokens: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(name, torch reference, fused) for one call of each step on `tokens` rows."""
    norm, act = RMSNorm(HIDDEN, 1e-5), SiluAndMul()
    rotary = RotaryEmbedding(HEAD_DIM, 8192, 100000.0)
    x, residual = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    angles = rotary.angles(torch.randint(0, 8192, (tokens,)), torch.float32)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE)
    # The in-place steps keep rewriting the same buffers: the values drift, the work does not.
    return [
        ("add+rms_norm", lambda: norm.forward_torch(x, residual), lambda: norm.forward(x, residual)),
        ("rms_norm", lambda: norm.forward_torch(x), lambda: norm.forward(x)),
        ("rotary q|k", lambda: rotary.rotate(angles, qk), lambda: rotary.rotate_owned(angles, qk)),
        ("silu_and_mul", lambda: act.forward_torch(gate_up), lambda: act.forward(gate_up)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    probe = torch.empty(1, dtype=torch.float32)
    if not fused.applies(probe):
        raise SystemExit("the fused kernels are not loaded here (see ops.attention.cpu_kernels.load_error())")
    with torch.inference_mode():
        for tokens in args.tokens:
            for name, ref, fz in steps(tokens):
                a, b = best_us(ref, args.reps, args.rounds), best_us(fz, args.reps, args.rounds)
                print(f"tokens {tokens:4d}  {name:13s} torch {a:8.1f} us  fused {b:8.1f} us  {a / b:5.1f}x")


if __name__ == "__main__":
    main()
