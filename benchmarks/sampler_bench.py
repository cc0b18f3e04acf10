"""Sampler cost per call: ms for B rows over a V-token vocabulary.

    python -m benchmarks.sampler_bench [--rows 64 256] [--vocab 49152] [--iters 10] [--threads N]

Cases: (a) all greedy; (b) all seeded temperature 0.8 + top_p 0.9, on two logit shapes:
"peaked" (LM-like, the nucleus is ~10 tokens, found among the top-64 candidates) and
"flat" (the nucleus is most of the vocabulary, so every row is fully sorted: the worst case).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model_exec.sampler import Sampler, SamplingMetadata
from request.sampling_params import SamplingParams


def make_meta(rows: int, params: SamplingParams) -> SamplingMetadata:
    return SamplingMetadata(
        params=[params] * rows,
        seeds=list(range(rows)),
        sample_indices=[0] * rows,
        output_lens=[10] * rows,
        num_samples=[1] * rows,
        prompt_token_ids=[[1, 2, 3]] * rows,
        output_token_ids=[[4, 5]] * rows,
        eos_token_ids=(0,),
    )


def time_ms(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, iters: int) -> tuple[float, float]:
    """(min, median) ms per call; the minimum is the figure to compare on a shared machine."""
    sampler(logits, meta)  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sampler(logits, meta)
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    print(f"{device} threads={torch.get_num_threads()} V={args.vocab}; ms per call, min of {args.iters}")
    for rows in args.rows:
        noise = torch.randn(rows, args.vocab, generator=gen)
        shapes = {"peaked": (noise * 5).to(device), "flat": noise.to(device)}
        all_greedy = make_meta(rows, SamplingParams(temperature=0.0))
        best, median = time_ms(sampler, shapes["peaked"], all_greedy, args.iters)
        print(f"B={rows:4d}  (a) all greedy                         {best:8.2f} ms  (median {median:.2f})")
        top_p = make_meta(rows, SamplingParams(temperature=0.8, top_p=0.9, seed=1))
        for name, logits in shapes.items():
            best, median = time_ms(sampler, logits, top_p, args.iters)
            print(f"B={rows:4d}  (b) seeded temperature+top_p, {name:6s}  {best:8.2f} ms  (median {median:.2f})")


if __name__ == "__main__":
    main()
