"""Offline throughput: raytp vs a Hugging Face transformers static-batching baseline, in one run.

Workload (vLLM's "random" dataset style): `--num-prompts` requests with random token-id
prompts of 16-768 tokens and 8-320 output tokens each (uniform, fixed seed), ignore_eos,
greedy. raytp gets all requests at once (continuous batching); the baseline runs HF
`generate` over batches of `--hf-batch-size` left-padded prompts, each batch generating
until its longest requested output (static batching: short requests wait for long ones).
Both count only the requested tokens.

    python benchmarks/throughput.py [--num-prompts 32] [--model M] [--repeats 1]

Prints requests/s, output tokens/s and total (prompt + output) tokens/s for each, and
the ratio raytp / HF.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def make_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    work = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(lo_in, hi_in)
        work.append(([rng.randrange(100, vocab - 100) for _ in range(n_in)], rng.randint(lo_out, hi_out)))
    return work


def run_raytp(llm: object, work: list[tuple[list[int], int]]) -> float:
    from raytp import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, work, strict=True))
    return elapsed


def run_hf(model: torch.nn.Module, work: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> float:
    # Sort by prompt length so batches pad little: a fair, commonly used static-batching setup.
    order = sorted(range(len(work)), key=lambda i: len(work[i][0]))
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = [work[i] for i in order[start : start + batch_size]]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (p, _) in enumerate(batch):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            new = max(n for _, n in batch)
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
    return time.perf_counter() - t0


def report(name: str, seconds: list[float], work: list[tuple[list[int], int]]) -> float:
    med = statistics.median(seconds)
    out_tokens = sum(n for _, n in work)
    total = out_tokens + sum(len(p) for p, _ in work)
    print(
        f"{name:>8}: {med:8.2f} s (median of {len(seconds)})  {len(work) / med:6.3f} req/s  "
        f"{out_tokens / med:8.1f} output tok/s  {total / med:8.1f} total tok/s"
    )
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 768))
    ap.add_argument("--output-len", type=int, nargs=2, default=(8, 320))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each system (median reported)")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from raytp import LLM

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.llm_engine.model_config.vocab_size
    work = make_workload(args, vocab)
    print(
        f"workload: {len(work)} requests, prompt {args.input_len[0]}-{args.input_len[1]} tokens "
        f"(total {sum(len(p) for p, _ in work)}), output {args.output_len[0]}-{args.output_len[1]} "
        f"(total {sum(n for _, n in work)}), torch threads {torch.get_num_threads()}"
    )
    run_raytp(llm, work[:2])  # warm-up
    raytp_s = [run_raytp(llm, work) for _ in range(args.repeats)]
    raytp_med = report("raytp", raytp_s, work)
    llm.llm_engine.shutdown()
    del llm
    if args.skip_hf:
        return

    from model_exec.source import resolve_model
    from tests.helpers.hf_reference import load_hf_reference_model

    model = load_hf_reference_model(resolve_model(args.model))
    hf_s = [run_hf(model, work, args.hf_batch_size, pad_id=0) for _ in range(args.repeats)]
    hf_med = report("hf", hf_s, work)
    print(f"raytp / hf throughput: {hf_med / raytp_med:.2f}x")


if __name__ == "__main__":
    main()
