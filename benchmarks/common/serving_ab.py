"""`raytp serve` with one set of flags against another: the same load on each, in alternating rounds.

Each round draws a fresh request set (no prefix cache helps; both configurations get the same one), and
starts a fresh server per configuration, in an order that alternates between rounds (a warm page cache or a
slower minute favours neither side). Only one server runs at a time, so the two never share the cores.
Prints each round and a table of medians with the ratio B / A.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

FIGURES = (
    ("request_throughput", "req/s"),
    ("tpot_p50_ms", "TPOT p50 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
)


def compare_flags(
    flags: dict[str, list[str]],
    *,
    rounds: int,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    request_rate: float,
    model: str | None = None,
) -> dict[str, dict[str, float]]:
    """Medians per configuration (two: A first, B second in `flags`) of the FIGURES keys."""
    from benchmarks.common.hf_model import hf_model_dir
    from benchmarks.common.servers import free_port, start_raytp
    from benchmarks.common.serving_load import run_load, summarize
    from benchmarks.common.workload import random_requests

    if len(flags) != 2:
        raise ValueError(f"compare_flags compares two configurations; got {list(flags)}")
    # a .gguf file is served as it is (its quantization is what an A/B may compare); anything else as the
    # safetensors directory vLLM would also load
    model_dir = model if model is not None and model.endswith(".gguf") else hf_model_dir(model)
    summaries: dict[str, list[dict[str, Any]]] = {name: [] for name in flags}
    for r in range(rounds):
        work = random_requests(num_prompts, input_len, output_len, 10000, 0, r)
        for name in list(flags) if r % 2 == 0 else list(reversed(flags)):
            srv = start_raytp(model_dir, free_port(), None, flags[name])
            try:
                srv.wait_ready()
                results, duration = asyncio.run(run_load(srv.base_url, work, request_rate, 1, {}))
            finally:
                srv.stop()
            s = summarize(results, duration, request_rate)
            summaries[name].append(s)
            print(
                f"round {r + 1} {name}: {s['request_throughput']:.2f} req/s, TPOT p50 {s['tpot_p50_ms']:.1f} ms, "
                f"ITL p50 {s['itl_p50_ms']:.1f} ms, TTFT p50 {s['ttft_p50_ms']:.0f} ms, failed {s['failed']}",
                flush=True,
            )
    med = {name: {k: statistics.median(s[k] for s in ss) for k, _ in FIGURES} for name, ss in summaries.items()}
    a, b = list(flags)
    print(f"\n| {request_rate:g} req/s, {num_prompts} prompts, {rounds} rounds | {a} | {b} | {b} / {a} |")
    print("| --- | --- | --- | --- |")
    for key, label in FIGURES:
        print(f"| {label} | {med[a][key]:.2f} | {med[b][key]:.2f} | {med[b][key] / med[a][key]:.2f}x |")
    return med
