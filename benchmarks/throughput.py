"""Offline throughput: raytp against a baseline (vLLM's CPU build, or HF transformers), in one run.

Workload (vLLM's "random" dataset style, `benchmarks/common/workload.py`): `--num-prompts` requests with
random token-id prompts of 16-768 tokens and 8-320 output tokens each (uniform, seeded),
ignore_eos, greedy. Every engine gets all requests at once; the HF baseline runs `generate` over
batches of `--hf-batch-size` left-padded prompts (static batching: short requests wait for long ones).

Engines are loaded once and measured in interleaved rounds (raytp, baseline, raytp, baseline, ...):
on a shared machine a noisy minute then hits both sides, not one. Each round draws a request set no
engine has seen (warm-up included), the same set for both sides, so no prefix cache is warm for the
timed prompts. Figures are medians over rounds.

    python benchmarks/throughput.py --baseline vllm --num-prompts 96 --rounds 2   # the issue-9 comparison
    python benchmarks/throughput.py                    # raytp vs HF static batching (32 requests)
    python benchmarks/throughput.py --baseline none    # raytp alone

`--baseline vllm` converts the embedded GGUF to an fp32 safetensors directory once
(`benchmarks/common/hf_model.py`) and points both engines at it, with the same 4 GiB KV budget; vLLM runs
from `.venv-vllm` (`bash benchmarks/setup_vllm.sh`). Prints requests/s, output and total
(prompt + output) tokens/s per engine, peak memory of each engine's processes, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common.proc_mem import MemPeak, PeakSampler
from benchmarks.common.workload import Request, describe, random_requests, total_tokens


def run_raytp(llm: Any, work: list[Request]) -> float:
    from raytp import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, work, strict=True))
    return elapsed


def run_hf(model: torch.nn.Module, work: list[Request], batch_size: int, pad_id: int = 0) -> float:
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
            model.generate(  # type: ignore[operator]
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


def report(name: str, seconds: list[float], work_tokens: tuple[int, int], n_requests: int) -> float:
    """Prints one engine's line; returns its median total tokens/s."""
    med = statistics.median(seconds)
    prompt_tokens, out_tokens = work_tokens
    total_tps = (prompt_tokens + out_tokens) / med
    runs = " ".join(f"{s:.1f}" for s in seconds)
    print(
        f"{name:>6}: {med:8.2f} s median of [{runs}]  {n_requests / med:6.3f} req/s  "
        f"{out_tokens / med:8.1f} output tok/s  {total_tps:8.1f} total tok/s"
    )
    return total_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", choices=("vllm", "hf", "none"), default="hf")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 768))
    ap.add_argument("--output-len", type=int, nargs=2, default=(8, 320))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rounds",
        "--repeats",
        type=int,
        default=None,
        help="default: 2 with --baseline vllm, else 1; interleaved timed rounds (median reported)",
    )
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true", help="same as --baseline none")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="raytp's torch threads (default: torch's choice)")
    ap.add_argument(
        "--quantization", default=None, help="raytp's quantization (default: the engine's; 'none' dequantizes a GGUF)"
    )
    ap.add_argument("--vllm-log", default=None, help="write vLLM's own log here (default: discarded)")
    args = ap.parse_args()
    if args.skip_hf:
        args.baseline = "none"
    if args.rounds is None:  # a comparison needs medians of >= 2 interleaved rounds
        args.rounds = 2 if args.baseline == "vllm" else 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from raytp import LLM

    engine_kw: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "quantization": args.quantization}
    if args.max_num_batched_tokens is not None:
        engine_kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    model = args.model
    if args.baseline == "vllm":
        from benchmarks.common.hf_model import hf_model_dir
        from benchmarks.common.vllm_baseline import KV_CACHE_BYTES

        model = hf_model_dir(args.model)
        engine_kw.update(dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES)
    # raytp runs in this process (in-process executor at TP=1): its memory is this process tree,
    # minus the vLLM driver's subtree once that exists.
    raytp_mem = PeakSampler(os.getpid()).start()
    llm = LLM(model, **engine_kw)
    vocab = llm.llm_engine.model_config.vocab_size

    def workload(round_index: int, n: int) -> list[Request]:
        return random_requests(n, args.input_len, args.output_len, vocab, args.seed, round_index)

    baseline, baseline_mem = _start_baseline(args, model, raytp_mem)
    cfg = llm.llm_engine.config
    print(
        f"model: {model or 'embedded SmolLM2-135M-Instruct'} ({llm.llm_engine.quantization}); raytp: torch threads "
        f"{torch.get_num_threads()}, "
        f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
        f"block_size {cfg.block_size}, KV blocks {llm.llm_engine.block_manager.num_device_blocks}"
    )
    print(f"workload per round: {describe(workload(0, args.num_prompts))}; {args.rounds} round(s), fresh prompts each")

    warm = workload(-1, 4)  # mixed lengths: every engine meets prefill chunks and decodes before timing
    run_raytp(llm, warm)
    if baseline is not None:
        baseline(warm)
    raytp_s: list[float] = []
    base_s: list[float] = []
    for r in range(args.rounds):
        work = workload(r, args.num_prompts)
        raytp_s.append(run_raytp(llm, work))
        if baseline is not None:
            base_s.append(baseline(work))
        print(f"round {r + 1}: raytp {raytp_s[-1]:.1f} s" + (f", {args.baseline} {base_s[-1]:.1f} s" if base_s else ""))
    llm.llm_engine.shutdown()

    tokens = total_tokens(workload(0, args.num_prompts))  # the same in every round: only token ids differ
    raytp_tps = report("raytp", raytp_s, tokens, args.num_prompts)
    mem = raytp_mem.stop()
    print(f"{'':>6}  {mem.describe()}")
    if baseline is None:
        return
    base_tps = report(args.baseline, base_s, tokens, args.num_prompts)
    base_peak = baseline_mem() if baseline_mem else None
    if base_peak is not None:
        print(f"{'':>6}  {base_peak.describe()}")
    print(f"raytp / {args.baseline} total tok/s: {raytp_tps / base_tps:.2f}x")
    _table_row(args, raytp_tps, base_tps, statistics.median(raytp_s), statistics.median(base_s), mem, base_peak)


def _table_row(
    args: argparse.Namespace,
    raytp_tps: float,
    base_tps: float,
    raytp_s: float,
    base_s: float,
    raytp_mem: MemPeak,
    base_mem: MemPeak | None,
) -> None:
    """The issue's table rows, ready to paste (medians; memory: peak over the whole run)."""
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    what = f"offline, {args.num_prompts} requests, prompts {lo_in}–{hi_in}, outputs {lo_out}–{hi_out}, ignore_eos"
    print("\n| workload | " + args.baseline + " | raytp | raytp / " + args.baseline + " |\n| --- | --- | --- | --- |")
    print(
        f"| {what} | {base_s:.0f} s, {base_tps:.0f} total tok/s | {raytp_s:.0f} s, {raytp_tps:.0f} total tok/s "
        f"| {raytp_tps / base_tps:.2f}× |"
    )
    if base_mem is not None:
        print(
            f"| peak RSS (PSS), offline engine processes | {base_mem.rss_bytes / 2**30:.2f} "
            f"({base_mem.pss_bytes / 2**30:.2f}) GiB | {raytp_mem.rss_bytes / 2**30:.2f} "
            f"({raytp_mem.pss_bytes / 2**30:.2f}) GiB | {raytp_mem.rss_bytes / base_mem.rss_bytes:.2f}× |"
        )


def _start_baseline(
    args: argparse.Namespace, model: str | None, raytp_mem: PeakSampler
) -> tuple[Callable[[list[Request]], float] | None, Callable[[], MemPeak] | None]:
    """The baseline's timed run and its memory report (None, None for --baseline none)."""
    if args.baseline == "vllm":
        from benchmarks.common.vllm_baseline import VllmOffline

        log = open(args.vllm_log, "wb") if args.vllm_log else None  # noqa: SIM115 (lives as long as vLLM)
        assert model is not None
        vllm = VllmOffline(model, log=log, seed=args.seed)
        raytp_mem.skip.add(vllm.pid)
        vllm.wait_ready()
        print(f"vLLM loaded in {vllm.load_s:.0f} s; its defaults: {vllm.config}")
        return vllm.generate, vllm.close
    if args.baseline == "hf":
        from model_exec.source import resolve_model
        from tests.helpers.hf_reference import load_hf_reference_model

        hf = load_hf_reference_model(resolve_model(model))
        return (lambda work: run_hf(hf, work, args.hf_batch_size)), None
    return None, None


if __name__ == "__main__":
    main()
