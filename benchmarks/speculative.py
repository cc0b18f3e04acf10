"""Speculative decoding (n-gram prompt lookup, a draft model) against the same engine without it (issue 38).

`offline`: one stream at a time on the embedded SmolLM2-135M-Instruct (fp32, CPU), greedy, chat prompts in
two groups: input-grounded (copy or edit given code, quote or repeat a given passage; 128-1,024 prompt
tokens) and open-ended (little overlap with the prompt). Both engines live in this process; each round
times every prompt on both, in alternating order, and the figure is the median over rounds of output
tokens/s per group, with the acceptance rate and mean acceptance length. Outputs must be identical.

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py offline --rounds 3
    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py offline --rounds 2 --no-ngram --draft tiny --draft self

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


def tiny_draft(root: Path) -> str:
    """A 2-layer random Llama with the default model's tokenizer (same vocabulary): a draft that proves the
    machinery and costs little; its proposals are mostly rejected."""
    import shutil

    from transformers import LlamaConfig

    from model_exec.source import gguf_metadata_dir, read_hf_config, resolve_model
    from tests.helpers.tiny_models import make_tiny_model

    source = resolve_model(None)
    hf = read_hf_config(source)
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=True,
    )
    path = make_tiny_model(root / "tiny-draft", config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(gguf_metadata_dir(source)) / name, Path(path) / name)
    return path


def spec_engines(args: argparse.Namespace, root: Path) -> dict[str, dict]:
    """name -> speculative_config of each engine compared with the plain one."""
    from model_exec.source import resolve_model

    engines: dict[str, dict] = {}
    if not args.no_ngram:
        engines["ngram"] = {**NGRAM, "num_speculative_tokens": args.k}
    for draft in args.draft:
        source = resolve_model(None)
        path = {"self": str(Path(source.path) / (source.gguf_file or "")), "tiny": None}.get(draft, draft)
        path = path or tiny_draft(root)
        engines[f"draft:{draft}"] = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
    return engines


def offline(args: argparse.Namespace) -> None:
    import tempfile

    from raytp import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    specs = spec_engines(args, Path(tempfile.mkdtemp(prefix="spec-bench-")))
    engines = {"plain": LLM(max_model_len=2048)}
    engines.update({name: LLM(max_model_len=2048, speculative_config=spec) for name, spec in specs.items()})
    groups = {"grounded": grounded_prompts(), "open-ended": open_prompts()}
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, int, str], list[int]] = {}
    for llm in engines.values():  # warm-up: kernels, page faults; not timed
        llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(max_tokens=8), use_tqdm=False)
    for r in range(args.rounds):
        for group, prompts in groups.items():
            for i, prompt in enumerate(prompts):
                names = list(engines)
                order = names[(r + i) % len(names) :] + names[: (r + i) % len(names)]  # each engine leads in turn
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
    print()
    for name in specs:
        keys = [(g, i) for g, ps in groups.items() for i in range(len(ps))]
        same = all(outputs[(g, i, "plain")] == outputs[(g, i, name)] for g, i in keys)
        sched = engines[name].llm_engine.scheduler
        acc = sched.spec_num_accepted_tokens / max(1, sched.spec_num_draft_tokens)
        length = 1 + sched.spec_num_accepted_tokens / max(1, sched.spec_num_drafts)
        per_pos = [round(n / max(1, sched.spec_num_drafts), 2) for n in sched.spec_accepted_per_pos]
        print(
            f"{name}: outputs identical: {same}; acceptance rate {acc:.1%}, mean acceptance length {length:.2f}, "
            f"per position {per_pos}"
        )
    columns = " | ".join(specs)
    print(f"\n| prompts (k = {args.k}, {args.rounds} rounds, medians of per-request tok/s) | plain | {columns} |")
    print("| --- | --- |" + " --- |" * len(specs))
    for group in groups:
        plain = statistics.median(rates[(group, "plain")])
        cells = [f"{(m := statistics.median(rates[(group, n)])):.1f} tok/s ({m / plain:.2f}x)" for n in specs]
        print(f"| {group} | {plain:.1f} tok/s | {' | '.join(cells)} |")
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
    o.add_argument(
        "--draft",
        action="append",
        default=[],
        help="also a draft-model engine: a path, `self` (the default model as its own draft: the acceptance "
        "upper bound) or `tiny` (a 2-layer random Llama with its tokenizer); repeatable",
    )
    o.add_argument("--no-ngram", action="store_true", help="leave out the n-gram engine")
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
