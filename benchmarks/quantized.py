"""Quantized weights, single stream: raytp's GGUF kept in blocks vs the same weights dequantized to fp32, with
llama.cpp decoding the same file in the same run (issue 39's table).

    python benchmarks/quantized.py                       # the default Q4_1 model, 2 threads, 5 rounds
    python benchmarks/quantized.py --llamacpp-python /tmp/lcppenv/bin/python   # add llama.cpp's row

The raytp engines are loaded once, in this process, from the same GGUF file: `quantization="none"` (every
weight dequantized to fp32, the reference path), `quantization="gguf"` (kept in blocks) and `quantization="int8"`
(the dequantized fp32 weights quantized again at load, Q8_0 blocks). Each round runs, in turn,
each engine on one request (a 128-token prompt of fixed English text, greedy, 256 new tokens, EOS ignored,
prefix caching off) and then llama.cpp's anchor (`/work/shared/anchors/llamacpp_anchor.py`, one run, its own
128-token prompt and 256 greedy tokens) in its own venv; medians over rounds are printed. Prefill = the time
of a max_tokens=1 request on that prompt; decode ms/token = (time of the 257-token request - prefill) / 256.

`--ab-layer-call` adds the blocks once more with the one-call decode layer off (`RAYTP_CPU_DECODE_LAYER=0`,
model_exec/models/fused_decode.py): the per-op Python layers it replaced, timed in the same rounds.

Perplexity: the first 1,100 tokens of benchmarks/data/ppl_text.txt (the opening of the GPL-3 text, fixed
English prose) through `prompt_logprobs` on each raytp engine. RSS: the process's resident memory before
and after each engine's load (each measured on top of the engines loaded before it).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TEXT = Path(__file__).with_name("data") / "ppl_text.txt"
ANCHOR = Path("/work/shared/anchors/llamacpp_anchor.py")
N_PROMPT, N_GEN, N_PPL = 128, 256, 1100


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def time_request(llm: Any, ids: list[int], max_tokens: int) -> float:
    from raytp import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == max_tokens
    return elapsed


def perplexity(llm: Any, ids: list[int]) -> float:
    from raytp import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = []
    for entry, token in zip(out[0].prompt_logprobs[1:], ids[1:], strict=True):
        lp = entry[token]
        logprobs.append(lp.logprob if hasattr(lp, "logprob") else float(lp))
    return math.exp(-sum(logprobs) / len(logprobs))


def llamacpp_round(python: str, gguf: str, threads: int) -> tuple[float, float] | None:
    """(prefill tok/s, decode ms/token) from one llama.cpp anchor run, or None when it failed."""
    run = subprocess.run(
        [python, str(ANCHOR), "--threads", str(threads), "--runs", "1", gguf], capture_output=True, text=True
    )
    m = re.search(r"^LLAMACPP \S+ prefill_tok_s=([\d.]+) decode_ms_per_token=([\d.]+)", run.stdout, re.M)
    if m is None:
        print("llama.cpp run failed:", run.stdout[-500:], run.stderr[-500:], file=sys.stderr)
        return None
    return float(m[1]), float(m[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llamacpp-python", default=None, help="python of a llama-cpp-cffi venv (llamacpp_venv.sh)")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument(
        "--ab-layer-call",
        action="store_true",
        help="add a row: the blocks without the one-call decode layer (RAYTP_CPU_DECODE_LAYER=0), interleaved",
    )
    ap.add_argument("--skip-int8", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from model_exec.source import resolve_model
    from raytp import LLM

    src = resolve_model(args.model)
    assert src.kind == "gguf", "this benchmark compares a GGUF file's blocks with its dequantized weights"
    engines: dict[str, Any] = {}
    rss: dict[str, tuple[float, float]] = {}
    blocks = f"gguf {Path(src.gguf_path).stem} (blocks)"
    variants = [("fp32 (dequantized)", "none", True), (blocks, "gguf", True)]  # (row, quantization, layer call)
    if args.ab_layer_call:
        variants.append((f"{blocks}, per-op Python layers", "gguf", False))
    if not args.skip_int8:
        variants.append(("int8 (of the fp32 weights)", "int8", True))
    for name, quant, layer_call in variants:
        if not layer_call:  # models/fused_decode.py reads the switch when a model is built
            os.environ["RAYTP_CPU_DECODE_LAYER"] = "0"
        before = rss_mb()
        engines[name] = LLM(
            model=args.model,
            quantization=quant,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=256 << 20,
            distributed_executor_backend="inprocess",
        )
        os.environ.pop("RAYTP_CPU_DECODE_LAYER", None)
        rss[name] = (before, rss_mb())
        print(f"loaded {name}: RSS {rss[name][0]:.0f} -> {rss[name][1]:.0f} MB", flush=True)
    tok = next(iter(engines.values())).get_tokenizer()
    text_ids = tok.encode(TEXT.read_text())
    prompt = text_ids[:N_PROMPT]
    for llm in engines.values():  # warm-up: kernels loaded, allocator warm
        time_request(llm, prompt, 2)
    prefill: dict[str, list[float]] = {n: [] for n in engines}
    decode: dict[str, list[float]] = {n: [] for n in engines}
    lcpp: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        for name, llm in engines.items():
            t_prefill = time_request(llm, prompt, 1)
            t_total = time_request(llm, prompt, N_GEN + 1)
            prefill[name].append(N_PROMPT / t_prefill)
            decode[name].append(1000 * (t_total - t_prefill) / N_GEN)
            # as it goes: on a loaded machine a run may be stopped before its table
            print(f"round {len(decode[name])} {name}: decode {decode[name][-1]:.2f} ms/token", flush=True)
        if args.llamacpp_python:
            got = llamacpp_round(args.llamacpp_python, src.gguf_path, args.threads)
            if got is not None:
                lcpp.append(got)
    load = os.getloadavg()[0]
    print(f"# {args.rounds} interleaved rounds, {args.threads} threads, 1-min load average at the end {load:.1f}")
    # the targets read as ratios to the first row (fp32, the same weights dequantized): decode tok/s
    # (blocks >= 3x, int8 >= 2x, and blocks >= llama.cpp's), prefill (>= 0.8x), perplexity (blocks within
    # +-0.5%, int8 <= +1%)
    print(
        "| engine | prefill tok/s (x fp32) | decode ms/token | decode tok/s (x fp32) | perplexity (vs fp32) "
        "| RSS before -> after load (MB) |"
    )
    print("|---|---|---|---|---|---|")
    base: tuple[float, float, float] | None = None  # fp32's prefill tok/s, decode ms/token, perplexity
    for name, llm in engines.items():
        ppl = float("nan") if args.skip_ppl else perplexity(llm, text_ids[:N_PPL])
        ms, pre = statistics.median(decode[name]), statistics.median(prefill[name])
        base = base or (pre, ms, ppl)
        print(
            f"| raytp {name} | {pre:.0f} ({pre / base[0]:.2f}x) | {ms:.2f} | {1000 / ms:.1f} ({base[1] / ms:.2f}x) "
            f"| {ppl:.4f} ({100 * (ppl / base[2] - 1):+.2f}%) | {rss[name][0]:.0f} -> {rss[name][1]:.0f} |"
        )
    if lcpp and base is not None:
        ms, pre = statistics.median(d for _, d in lcpp), statistics.median(p for p, _ in lcpp)
        print(
            f"| llama.cpp (llama-cpp-cffi) same file | {pre:.0f} ({pre / base[0]:.2f}x) | {ms:.2f} "
            f"| {1000 / ms:.1f} ({base[1] / ms:.2f}x) | | |"
        )
    print(
        "per-round decode ms/token:",
        {n: [round(v, 2) for v in d] for n, d in decode.items()},
        "llama.cpp:",
        [round(d, 2) for _, d in lcpp],
    )


if __name__ == "__main__":
    main()
