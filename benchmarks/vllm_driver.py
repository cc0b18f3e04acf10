"""vLLM's side of the `--baseline vllm` benchmarks; runs under vLLM's own interpreter (.venv-vllm), not ours.

It imports vLLM and the standard library only, never raytp. `benchmarks/common/vllm_baseline.py` starts it
with the CPU backend's environment, then drives it with one JSON command per line on stdin and
reads one JSON reply per line from the file descriptor named by `--reply-fd` (vLLM logs to stdout and
stderr, so replies travel on a channel of their own). The harness builds every workload and sends
token ids, so both engines get identical prompts by construction.

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": [n, ...]}  ->  {"elapsed_s": t, "output_tokens": [...]}
    {"op": "quit"}

The first reply, once the model is loaded, is {"ready": true, "load_s": t, "config": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF safetensors directory")
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed)
    reply.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "config": _config(llm)}) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] != "generate":
            raise ValueError(f"unknown op {cmd['op']!r}")
        prompts: list[Any] = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in cmd["max_tokens"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        reply.write(json.dumps({"elapsed_s": elapsed, "output_tokens": [len(o.outputs[0].token_ids) for o in outs]}))
        reply.write("\n")


def _config(llm: Any) -> dict[str, Any]:
    """The scheduling figures that decide throughput, so a report can show what vLLM chose by default."""
    cfg = llm.llm_engine.vllm_config
    sched, cache = cfg.scheduler_config, cfg.cache_config
    return {
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": cfg.model_config.max_model_len,
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "num_kv_blocks": getattr(cache, "num_gpu_blocks", None),
    }


if __name__ == "__main__":
    main()
