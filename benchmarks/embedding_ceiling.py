"""The fp32 GEMM ceiling of the embedding benchmark: how fast can any fp32 runner embed its texts here?

A BERT-base layer is four products per token: qkv [768 -> 2304], attention output [768 -> 768], FFN up
[768 -> 3072], FFN down [3072 -> 768]: 2 x 7.08M FLOPs per token per layer, 170 MFLOPs per token for 12
layers; attention adds 4 x len x 768 FLOPs per token per layer (3.6% at 145 tokens). This script times
each product at a pooling step's row count with torch's three CPU paths (MKL `F.linear`, oneDNN's
prepacked layout, raytp's panels), takes the best per shape, and weights them by the layer's FLOP mix:
the machine's fp32 linear-layer rate. Two readings:

- `--threads 1`, CPU time (`time.process_time`): one core's rate, which other processes on a shared
  machine do not distort (they take the core away, they do not slow its FMAs); the 2-core ceiling is
  twice it (an upper bound: perfect scaling).
- `--threads N`, wall time: what N threads get now (meaningful on an idle machine only).

Then it counts the FLOPs of `benchmarks.embedding_throughput`'s workload (same seeded lengths): packed
(what raytp computes: no padding) and sentence-transformers' (length-sorted batches padded to their
longest), and with `--st-seconds` (sentence-transformers' measured time for that workload) prints the
rate sentence-transformers reaches, its fraction of the ceiling, and the largest speed-up any fp32 runner
could have over it: sentence-transformers' time over the time the packed FLOPs take at the ceiling.

    python -m benchmarks.embedding_ceiling --threads 1 --num-texts 300 --st-seconds 33.5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, FFN, LAYERS = 768, 3072, 12
SHAPES = ((HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, FFN), (FFN, HIDDEN))  # (in, out)
LINEAR_FLOPS_PER_TOKEN = 2 * LAYERS * sum(i * o for i, o in SHAPES)


def _paths(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from model_exec.layers import cpu_gemm

    paths: dict[str, Callable[[], torch.Tensor]] = {"mkl F.linear": lambda: F.linear(x, w, b)}
    if cpu_gemm.can_pack(w):
        packed = cpu_gemm.pack_weight(w)
        paths["oneDNN packed"] = lambda: cpu_gemm.packed_linear(x, packed, b)
    if cpu_gemm.can_use_panels(w):
        panels = cpu_gemm.pack_panels(w)
        paths["raytp panels"] = lambda: cpu_gemm.panel_linear(x, panels, w.shape[0], b)
    return paths


def gemm_rates(rows: int, threads: int, repeats: int) -> dict[tuple[int, int], dict[str, float]]:
    """GFLOP/s per shape and path: best of `repeats` interleaved runs (CPU time with one thread, else wall)."""
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    rates: dict[tuple[int, int], dict[str, float]] = {}
    for fan_in, fan_out in SHAPES:
        x, w, b = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in) * 0.02, torch.randn(fan_out)
        paths = _paths(x, w, b)
        for run in paths.values():
            run()
        best = {name: float("inf") for name in paths}
        for _ in range(repeats):
            for name, run in paths.items():
                start = clock()
                run()
                best[name] = min(best[name], clock() - start)
        rates[(fan_in, fan_out)] = {name: 2 * rows * fan_in * fan_out / s / 1e9 for name, s in best.items()}
    return rates


def layer_rate(rates: dict[tuple[int, int], dict[str, float]], path: str | None) -> float:
    """The layer's FLOP-weighted rate (harmonic mean) with one path, or the best path per shape (None)."""
    seconds = sum(i * o / (max(r.values()) if path is None else r[path]) for (i, o), r in rates.items())
    return sum(i * o for i, o in SHAPES) / seconds


def workload_flops(num_texts: int, batch: int, seed: int) -> tuple[int, float, float, float]:
    """(tokens, packed FLOPs, sentence-transformers' padded FLOPs, packed attention FLOPs) of the benchmark."""
    from benchmarks.embedding_throughput import _texts

    lengths = [len(t.split()) + 2 for t in _texts(num_texts, seed)]  # one token per word, [CLS] and [SEP]
    tokens = sum(lengths)
    ordered = sorted(lengths, reverse=True)
    groups = [ordered[i : i + batch] for i in range(0, len(ordered), batch)]
    attention = lambda n: 4 * n * n * HIDDEN * LAYERS  # noqa: E731  # q k^T and p v for one sequence
    packed = tokens * LINEAR_FLOPS_PER_TOKEN + sum(attention(n) for n in lengths)
    padded = sum(len(g) * (g[0] * LINEAR_FLOPS_PER_TOKEN + attention(g[0])) for g in groups)
    return tokens, packed, padded, sum(attention(n) for n in lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4608, help="tokens per step (32 texts of ~145 tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-texts", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, default=2, help="cores the ceiling scales a one-thread rate to")
    ap.add_argument("--st-seconds", type=float, help="sentence-transformers' measured time for this workload")
    args = ap.parse_args()

    rates = gemm_rates(args.rows, args.threads, args.repeats)
    unit = "GFLOP/s per core (CPU time)" if args.threads == 1 else f"GFLOP/s, {args.threads} threads (wall)"
    print(f"{args.rows} rows, {unit}; best of {args.repeats}")
    names = sorted({n for r in rates.values() for n in r})
    print(f"{'shape':>14s} " + " ".join(f"{n:>14s}" for n in names))
    for (i, o), r in rates.items():
        print(f"{f'{i}->{o}':>14s} " + " ".join(f"{r.get(n, float('nan')):14.1f}" for n in names))
    for n in names:
        if all(n in r for r in rates.values()):
            print(f"BERT layer mix, {n}: {layer_rate(rates, n):.1f}")
    best = layer_rate(rates, None)
    ceiling = best * (args.cores if args.threads == 1 else 1)
    print(f"BERT layer mix, best path per shape: {best:.1f} -> ceiling {ceiling:.1f} GFLOP/s")

    tokens, packed, padded, attention = workload_flops(args.num_texts, args.batch_size, args.seed)
    floor = packed / (ceiling * 1e9)
    print(f"workload: {args.num_texts} texts, {tokens} tokens; packed {packed / 1e12:.2f} TFLOP "
          f"(attention {attention / 1e12:.2f}), sentence-transformers padded {padded / 1e12:.2f} TFLOP; "
          f"packed FLOPs at the ceiling take {floor:.1f} s")  # fmt: skip
    if args.st_seconds:
        st_rate = padded / args.st_seconds / 1e9
        print(f"sentence-transformers: {st_rate:.1f} GFLOP/s = {st_rate / ceiling:.0%} of the ceiling; "
              f"largest fp32 speed-up over it: {args.st_seconds / floor:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
