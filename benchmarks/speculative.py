"""Speculative decoding (n-gram prompt lookup) against the same engine without it (issue 38).

`offline`: one stream at a time on the embedded SmolLM2-135M-Instruct (fp32, CPU), greedy, chat prompts in
two groups: input-grounded (copy or edit given code, quote or repeat a given passage; 128-1,024 prompt
tokens) and open-ended (little overlap with the prompt). Both engines live in this process; each round
times every prompt on both, in alternating order, and the figure is the median over rounds of output
tokens/s per group, with the acceptance rate and mean acceptance length. Outputs must be identical.

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py offline --rounds 3

`serve`: the serving benchmark's workload (benchmarks/serving.py: Poisson arrivals, random token-id
prompts, greedy, ignore_eos) against `raytp serve` with and without `--speculative-config`, one server at a
time, started fresh for each round, alternating which goes first; prints throughput and TPOT / TTFT p50.

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py serve --request-rate 2 --num-prompts 48 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _source(path: str, start: int, chars: int) -> str:
    return (REPO / path).read_text()[start : start + chars]


def grounded_prompts() -> list[str]:
    """Work whose answer repeats long runs of its prompt (128-1,024 prompt tokens)."""
    code = _source("kv/block_pool.py", 0, 2400)
    short_code = _source("scheduler/sequence.py", 1800, 900)
    passage = _source("docs/architecture.md", 200, 1800)
    return [
        f"Copy the following Python code exactly, with no changes and no comments:\n\n{code}",
        f"Rewrite this code with the variable name `seq` renamed to `sequence` everywhere. Output only code.\n\n"
        f"{short_code}",
        f"Here is a passage:\n\n{passage}\n\nRepeat the passage above word for word.",
        f"Here is a document:\n\n{passage}\n\nQuote the sentences of the document that mention imports, exactly.",
    ]


def open_prompts() -> list[str]:
    return [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how rainbows form, for a ten-year-old.",
        "Give me ten ideas for a child's birthday party.",
        "What are the pros and cons of living in a big city?",
    ]


def offline(args: argparse.Namespace) -> None:
    from raytp import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {
        "plain": LLM(max_model_len=2048),
        "ngram": LLM(max_model_len=2048, speculative_config={**NGRAM, "num_speculative_tokens": args.k}),
    }
    groups = {"grounded": grounded_prompts(), "open-ended": open_prompts()}
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for llm in engines.values():  # warm-up: kernels, page faults; not timed
        llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=8), use_tqdm=False)
    for r in range(args.rounds):
        for group, prompts in groups.items():
            for i, prompt in enumerate(prompts):
                order = list(engines) if (r + i) % 2 == 0 else list(reversed(engines))
                for name in order:
                    t0 = time.perf_counter()
                    out = engines[name].chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0]
                    dt = time.perf_counter() - t0
                    ids = out.outputs[0].token_ids
                    outputs.setdefault((group, i, name), ids)
                    rates.setdefault((group, name), []).append(len(ids) / dt)
                    if r == 0:
                        print(
                            f"{group} #{i} {name}: {len(out.prompt_token_ids)} prompt tokens, {len(ids)} out, "
                            f"{len(ids) / dt:.1f} tok/s",
                            flush=True,
                        )
    same = all(outputs[(g, i, "plain")] == outputs[(g, i, "ngram")] for g, ps in groups.items() for i in range(len(ps)))
    sched = engines["ngram"].llm_engine.scheduler
    acc = sched.spec_num_accepted_tokens / max(1, sched.spec_num_draft_tokens)
    length = 1 + sched.spec_num_accepted_tokens / max(1, sched.spec_num_drafts)
    print(f"\noutputs identical: {same}; acceptance rate {acc:.1%}, mean acceptance length {length:.2f}")
    print(f"per position: {[round(n / max(1, sched.spec_num_drafts), 2) for n in sched.spec_accepted_per_pos]}")
    print(f"\n| prompts (k = {args.k}, {args.rounds} rounds, medians of per-request tok/s) | plain | n-gram | ratio |")
    print("| --- | --- | --- | --- |")
    for group in groups:
        plain, ngram = (statistics.median(rates[(group, n)]) for n in ("plain", "ngram"))
        print(f"| {group} | {plain:.1f} tok/s | {ngram:.1f} tok/s | {ngram / plain:.2f}x |")
    for llm in engines.values():
        llm.llm_engine.shutdown()


def serve(args: argparse.Namespace) -> None:
    from benchmarks.common.serving_ab import compare_flags

    ngram = ["--speculative-config", json.dumps({**NGRAM, "num_speculative_tokens": args.k})]
    compare_flags(
        {"plain": [], "n-gram": ngram},
        rounds=args.rounds,
        num_prompts=args.num_prompts,
        input_len=tuple(args.input_len),
        output_len=tuple(args.output_len),
        request_rate=args.request_rate,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    o = sub.add_parser("offline")
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--max-tokens", type=int, default=192)
    o.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    s = sub.add_parser("serve")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--request-rate", type=float, default=2.0)
    s.add_argument("--num-prompts", type=int, default=48)
    s.add_argument("--input-len", type=int, nargs=2, default=[16, 512])
    s.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    s.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    offline(args) if args.mode == "offline" else serve(args)


if __name__ == "__main__":
    main()
