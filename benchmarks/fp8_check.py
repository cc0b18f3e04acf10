"""`quantization="fp8"` against the same model in bf16 on one CUDA device (issue 39: gpu_check's fp8 row).

    PYTHONPATH=. python benchmarks/fp8_check.py MODEL_DIR [--tokens 32] [--single 128 256]

`compare_fp8_with_bf16` runs raytp in-process (no Ray) twice, bf16 then fp8 (or fp8 only, given the bf16
run's sequences as `reference`), on the same greedy prompts with top-k logprobs, and reports: how many
sequences agree token for token, the fraction of first tokens that agree, the first divergence per sequence
(vLLM's check_logprobs_close: each side's token in the other's top-k there, or a mismatch), the largest
logprob difference of the chosen token where the sequences still agree, the KV blocks each run sized, and,
with `single_stream`, single-stream decode ms/token of each. Needs a device of compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

Seq = tuple[list[int], list[dict[int, float]]]  # greedy tokens, top-k logprobs per position


def _llm(model_dir: str, **kwargs: Any) -> Any:
    from raytp import LLM

    return LLM(model_dir, device="cuda", distributed_executor_backend="inprocess", **kwargs)


def _greedy(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, logprobs: int | None) -> list[Seq]:
    from raytp import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]


def _ms_per_token(llm: Any, prompt_len: int, out_tokens: int, vocab: int) -> float:
    rng = random.Random(3)
    prompt = [[1] + [rng.randrange(3, vocab) for _ in range(prompt_len - 1)]]
    _greedy(llm, prompt, 8, None)  # warm-up
    times = []
    for n in (1, out_tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _greedy(llm, prompt, n, None)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return round((times[1] - times[0]) / (out_tokens - 1) * 1e3, 3)


def _run(
    model_dir: str,
    quantization: str | None,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    top: int,
    single_stream: tuple[int, int] | None,
    **kwargs: Any,
) -> tuple[list[Seq], dict[str, Any]]:
    llm = _llm(model_dir, dtype="bfloat16", quantization=quantization, **kwargs)
    try:
        shard = llm.llm_engine.executor.worker.shard
        info: dict[str, Any] = {
            "quantization": shard.quantization,
            "kv_blocks": shard.cache.num_device_blocks,
            "cuda_graphs": shard.runner.decode_graphs is not None,
        }
        seqs = _greedy(llm, prompts, max_tokens, top)
        if single_stream is not None:
            with open(f"{model_dir}/config.json") as f:
                vocab = int(json.load(f)["vocab_size"])
            info["single_stream_ms_per_token"] = _ms_per_token(llm, *single_stream, vocab)
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return seqs, info


def compare(ours: list[Seq], reference: list[Seq]) -> dict[str, Any]:
    """Agreement of fp8 (`ours`) with bf16 (`reference`), vLLM's check_logprobs_close per sequence."""
    identical, first_same, max_diff = 0, 0, 0.0
    diverged: list[dict[str, Any]] = []
    for i, ((a_ids, a_lp), (b_ids, b_lp)) in enumerate(zip(ours, reference, strict=True)):
        first_same += int(a_ids[:1] == b_ids[:1])
        for pos, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
            if a != b:
                close = a in b_lp[pos] and b in a_lp[pos]
                diverged.append({"seq": i, "position": pos, "within_top_k": close})
                break
            if a in a_lp[pos] and a in b_lp[pos]:
                max_diff = max(max_diff, abs(a_lp[pos][a] - b_lp[pos][a]))
        else:
            identical += 1
    return {
        "sequences": len(ours),
        "identical_sequences": identical,
        "first_token_agreement": first_same / max(len(ours), 1),
        "diverged": diverged,
        "mismatch": [d for d in diverged if not d["within_top_k"]],
        "max_logprob_diff_where_agreeing": round(max_diff, 4),
    }


def compare_fp8_with_bf16(
    model_dir: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 32,
    top_logprobs: int = 5,
    reference: list[Seq] | None = None,
    single_stream: tuple[int, int] | None = None,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """The fp8 row: fp8 vs bf16 greedy parity (and single-stream speed with `single_stream` = (prompt
    length, output tokens)). `reference`: the bf16 run's sequences (same prompts, max_tokens, top-k), to
    skip running bf16 again; `llm_kwargs` go to both LLMs (gpu_memory_utilization, max_model_len, ...)."""
    report: dict[str, Any] = {}
    if reference is None:
        reference, report["bf16"] = _run(
            model_dir, None, prompts, max_tokens, top_logprobs, single_stream, **llm_kwargs
        )
    ours, fp8_info = _run(model_dir, "fp8", prompts, max_tokens, top_logprobs, single_stream, **llm_kwargs)
    report.update(fp8_info)
    report.update(compare(ours, reference))
    bf16_ms = report.get("bf16", {}).get("single_stream_ms_per_token")
    if bf16_ms and "single_stream_ms_per_token" in fp8_info:
        report["fp8_over_bf16_ms_per_token"] = round(fp8_info["single_stream_ms_per_token"] / bf16_ms, 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--single", type=int, nargs=2, metavar=("IN", "OUT"), default=None)
    args = parser.parse_args()
    rng = random.Random(2)
    with open(f"{args.model}/config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(args.prompt_len - 1)] for _ in range(args.prompts)]
    report = compare_fp8_with_bf16(args.model, prompts, args.tokens, single_stream=args.single, max_model_len=2048)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
