"""JSON mode offline, one engine per run (issue 41): the length counts at scale, and the model's next-token
distributions teacher-forced, each engine in its own interpreter (vLLM from .venv-vllm, raytp from .venv).

`lengths`: three prompts x `--seeds` seeds, temperature 0.7, `max_tokens` 150, `--format object|schema|none`;
prints valid / cut / median / mean and writes every answer to `--out`. `logprobs`: the top-20 next-token
logprobs at four cut points of each of the first 40 valid answers in `--answers` (a `lengths` output),
the last one just after the closing brace (where EOS competes); `sequences`: the log-probability of each
whole answer in `--answers` (every sampled token, EOS included) under this engine; `compare A B` prints the
largest difference between two `logprobs` or two `sequences` files.

    S=benchmarks/json_mode_offline.py
    .venv-vllm/bin/python $S lengths --engine vllm --model HF_DIR --out v.json
    PYTHONPATH=. .venv/bin/python $S lengths --engine raytp --model HF_DIR --out r.json
    .venv-vllm/bin/python $S logprobs --engine vllm --model HF_DIR --answers v.json --out lv.json
    PYTHONPATH=. .venv/bin/python $S logprobs --engine raytp --model HF_DIR --answers v.json --out lr.json
    python3 $S compare lv.json lr.json
    .venv-vllm/bin/python $S sequences --engine vllm --model HF_DIR --answers r.json --out sv.json
    PYTHONPATH=. .venv/bin/python $S sequences --engine raytp --model HF_DIR --answers r.json --out sr.json
    python3 $S compare sr.json sv.json

HF_DIR: `python -m benchmarks.common.hf_model` prints it. vLLM's CPU backend wants the environment of
benchmarks/common/vllm_baseline.py (VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
VLLM_CPU_KVCACHE_SPACE=2).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

PROMPTS = ["Describe Paris as JSON.", "Give me a JSON object about a cat.", "Return JSON with a person's name and age."]
# `--format schema`: free-text string fields (issue 41's second target)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "tags": {"type": "array"}},
    "required": ["name", "description"],
}


def engine(name: str, model: str) -> tuple[Any, Any, Any]:
    """(LLM, SamplingParams, StructuredOutputsParams) of `name`; the two APIs match by design."""
    if name == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        return (
            LLM(model, max_num_seqs=32, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0),
            SamplingParams,
            StructuredOutputsParams,
        )
    from raytp import LLM
    from request.sampling_params import SamplingParams as RaytpSamplingParams
    from request.structured_outputs import StructuredOutputsParams as RaytpStructured

    return LLM(model, max_num_seqs=32), RaytpSamplingParams, RaytpStructured


def lengths(args: argparse.Namespace) -> None:
    llm, sampling, structured = engine(args.engine, args.model)
    constraints: dict[str, dict[str, Any] | None] = {"object": {"json_object": True}, "schema": {"json": SCHEMA}}
    constraint = constraints.get(args.format)
    jobs = [(p, s) for p in PROMPTS for s in range(args.seed_offset, args.seed_offset + args.seeds)]
    params = [
        sampling(
            temperature=0.7,
            max_tokens=150,
            seed=s,
            structured_outputs=structured(**constraint) if constraint else None,
        )
        for _, s in jobs
    ]
    outs = llm.chat([[{"role": "user", "content": p}] for p, _ in jobs], params)
    rows: list[dict[str, Any]] = []
    for (prompt, seed), out in zip(jobs, outs, strict=True):
        c = out.outputs[0]
        try:
            valid = isinstance(json.loads(c.text), dict)
        except ValueError:
            valid = False
        rows.append(
            {
                "prompt": prompt,
                "seed": seed,
                "valid": valid,
                "cut": c.finish_reason == "length",
                "tokens": len(c.token_ids),
                "token_ids": list(c.token_ids),
                "text": c.text,
            }
        )
    with open(args.out, "w") as f:
        json.dump(rows, f)
    n = [r["tokens"] for r in rows]
    num_valid, num_cut = sum(bool(r["valid"]) for r in rows), sum(bool(r["cut"]) for r in rows)
    print(f"{args.engine} {args.format}: n {len(rows)}, valid {num_valid}, cut {num_cut}, ", end="")
    print(f"median {statistics.median(n)}, mean {statistics.mean(n):.1f}")


def logprobs(args: argparse.Namespace) -> None:
    llm, sampling, _ = engine(args.engine, args.model)
    with open(args.answers) as f:
        answers = [r for r in json.load(f) if r["valid"]][:40]
    tok = llm.get_tokenizer()
    prompts = []
    for r in answers:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(chat + r["text"], add_special_tokens=False)
        prompts += [ids[:cut] for cut in (len(ids) - 12, len(ids) - 6, len(ids) - 2, len(ids))]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sampling(temperature=1.0, max_tokens=1, logprobs=20)
    )
    rows = [{str(k): float(getattr(v, "logprob", v)) for k, v in o.outputs[0].logprobs[0].items()} for o in outs]
    with open(args.out, "w") as f:
        json.dump(rows, f)
    print(f"{args.engine}: top-20 logprobs at {len(rows)} positions -> {args.out}")


def sequences(args: argparse.Namespace) -> None:
    """The raw log-probability of each whole answer in `--answers` (every sampled token, EOS included) under
    this engine: one prefill per answer with `prompt_logprobs=0`. Two engines whose per-answer sums agree
    give every statistic of their outputs (validity, length, cut-off) the same expectation."""
    llm, sampling, _ = engine(args.engine, args.model)
    with open(args.answers) as f:
        answers = json.load(f)[: args.limit]
    tok = llm.get_tokenizer()
    prompts, starts = [], []
    for r in answers:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        head = tok.encode(chat, add_special_tokens=False)
        prompts.append(head + r["token_ids"])
        starts.append(len(head))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sampling(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    )
    rows = []
    for r, ids, start, o in zip(answers, prompts, starts, outs, strict=True):
        lps = [o.prompt_logprobs[i][ids[i]] for i in range(start, len(ids))]
        total = sum(float(getattr(v, "logprob", v)) for v in lps)
        rows.append({"seed": r["seed"], "prompt": r["prompt"], "cut": r["cut"], "logprob": total})
    with open(args.out, "w") as f:
        json.dump(rows, f)
    print(f"{args.engine}: whole-answer logprobs of {len(rows)} answers -> {args.out}")


def compare(args: argparse.Namespace) -> None:
    with open(args.a) as f:
        a = json.load(f)
    with open(args.b) as f:
        b = json.load(f)
    if a and "logprob" in a[0]:  # `sequences` outputs: one whole answer per row
        deltas = [abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b, strict=True)]
        cut = sum(bool(x["cut"]) for x in a)
        print(f"{len(a)} answers ({cut} cut off): largest |log p_a - log p_b| {max(deltas):.2e}, ", end="")
        print(f"median {statistics.median(deltas):.2e}; largest likelihood ratio {math.exp(max(deltas)):.6f}")
        return
    worst = max(abs(math.exp(x[k]) - math.exp(y[k])) for x, y in zip(a, b, strict=True) for k in set(x) & set(y))
    print(f"{len(a)} positions: largest |p_a - p_b| over the shared top-20 tokens {worst:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("lengths", "logprobs", "sequences"):
        p = sub.add_parser(name)
        p.add_argument("--engine", choices=["raytp", "vllm"], required=True)
        p.add_argument("--model", required=True, help="the HF directory both engines load")
        p.add_argument("--out", required=True)
    sub.choices["lengths"].add_argument("--format", choices=["object", "schema", "none"], default="object")
    sub.choices["lengths"].add_argument("--seeds", type=int, default=96)
    sub.choices["lengths"].add_argument("--seed-offset", type=int, default=0)
    sub.choices["logprobs"].add_argument("--answers", required=True, help="a `lengths` output")
    sub.choices["sequences"].add_argument("--answers", required=True, help="a `lengths` output")
    sub.choices["sequences"].add_argument("--limit", type=int, default=96, help="the first N answers")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = ap.parse_args()
    {"lengths": lengths, "logprobs": logprobs, "sequences": sequences, "compare": compare}[args.cmd](args)


if __name__ == "__main__":  # vLLM's engine core starts by spawn, which re-imports this module
    main()
