"""Single-stream latency: one request at a time, raytp against vLLM's CPU build (or alone), ms per output token.

Each round sends one fresh random token-id prompt of `--input-len` tokens asking for `--output-len`
tokens (ignore_eos, greedy) to each engine in turn (raytp, vLLM, raytp, vLLM, ...); the same prompt to
both sides within a round, a new one every round, so no prefix cache helps. ms/token is the request's
wall time over its output tokens (prefill included, as a user waits for it); the median over rounds is
reported. Both engines are loaded once, before the first round, from the same fp32 safetensors
directory (`benchmarks/common/hf_model.py`), with the same 4 GiB KV budget.

    python benchmarks/latency.py --baseline vllm            # the issue-9 comparison: 128 in / 256 out
    python benchmarks/latency.py                            # raytp alone

It also prints the floor a decode step cannot beat on this machine: the time to read every weight
once (the model's fp32 bytes over the measured memory read bandwidth).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common.proc_mem import PeakSampler
from benchmarks.common.workload import random_requests
from benchmarks.throughput import run_raytp


def weight_read_floor_ms(hf_dir: str) -> tuple[float, float]:
    """(GB of fp32 weights, ms to read that many bytes once): the bandwidth bound of one decode step.

    The bytes are the fp32 safetensors' (a tied embedding is stored, and read by the LM head, once).
    Bandwidth is measured by summing a buffer of that size (best of 5), with raytp's torch threads.
    """
    nbytes = sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors"))
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / 1e9, 1000 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", choices=("vllm", "none"), default="none")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-panel-gemm", action=argparse.BooleanOptionalAction, default=True, help="EngineConfig.cpu_panel_gemm"
    )
    ap.add_argument("--vllm-log", default=None, help="write vLLM's own log here (default: discarded)")
    args = ap.parse_args()

    from benchmarks.common.hf_model import hf_model_dir
    from benchmarks.common.vllm_baseline import KV_CACHE_BYTES, VllmOffline
    from raytp import LLM

    hf_dir = hf_model_dir(args.model)  # converted once, cached; raytp alone keeps reading args.model
    model = hf_dir if args.baseline == "vllm" else args.model
    raytp_mem = PeakSampler(os.getpid()).start()
    llm = LLM(model, dtype="float32", kv_cache_memory_bytes=KV_CACHE_BYTES, cpu_panel_gemm=args.cpu_panel_gemm)
    vocab = llm.llm_engine.model_config.vocab_size
    vllm = None
    if args.baseline == "vllm":
        assert model is not None
        log = open(args.vllm_log, "wb") if args.vllm_log else None  # noqa: SIM115 (lives as long as vLLM)
        vllm = VllmOffline(model, log=log, seed=args.seed)
        raytp_mem.skip.add(vllm.pid)
        vllm.wait_ready()
        print(f"vLLM loaded in {vllm.load_s:.0f} s")

    def one(round_index: int) -> list[tuple[list[int], int]]:
        lens = (args.input_len, args.input_len)
        return random_requests(1, lens, (args.output_len, args.output_len), vocab, args.seed, round_index)

    run_raytp(llm, one(-1))  # warm-up, on a prompt no timed round repeats
    if vllm is not None:
        vllm.generate(one(-1))
    raytp_ms: list[float] = []
    vllm_ms: list[float] = []
    for r in range(args.rounds):
        work = one(r)
        raytp_ms.append(1000 * run_raytp(llm, work) / args.output_len)
        if vllm is not None:
            vllm_ms.append(1000 * vllm.generate(work) / args.output_len)
        print(f"round {r + 1}: raytp {raytp_ms[-1]:.1f} ms/token" + (f", vllm {vllm_ms[-1]:.1f}" if vllm_ms else ""))

    llm.llm_engine.shutdown()
    mem = raytp_mem.stop()  # before the floor's 0.5 GB buffer, which is not raytp's memory
    gb, floor = weight_read_floor_ms(hf_dir)
    raytp_med = statistics.median(raytp_ms)
    print(f"single stream, {args.input_len} in / {args.output_len} out, median of {args.rounds} rounds:")
    print(f" raytp: {raytp_med:6.1f} ms/token   {mem.describe()}")
    print(
        f" floor: {floor:6.1f} ms/token   (reading {gb:.2f} GB of weights once; raytp is {raytp_med / floor:.1f}x it)"
    )
    if vllm is None:
        return
    vllm_peak = vllm.close()
    vllm_med = statistics.median(vllm_ms)
    print(f"  vllm: {vllm_med:6.1f} ms/token   {vllm_peak.describe()}")
    print(f"raytp / vllm ms/token: {raytp_med / vllm_med:.2f}x  (speed {vllm_med / raytp_med:.2f}x)")
    print("\n| workload | vllm | raytp | raytp / vllm |\n| --- | --- | --- | --- |")
    print(
        f"| single stream, {args.input_len} in / {args.output_len} out | {vllm_med:.0f} ms/token "
        f"| {raytp_med:.0f} ms/token | {vllm_med / raytp_med:.2f}× (speed) |"
    )


if __name__ == "__main__":
    main()
