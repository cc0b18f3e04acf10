"""What gpu_check measures inside raytp's engine on a device: decode steps timed and profiled at a fixed batch,
kernels sorted into GEMMs, attention and the rest, compiled Triton variants counted, and teacher-forced
logprob parity.

Decode steps are driven through `LLM.llm_engine.step()` directly, so a timed window holds only steps whose
rows all decode: requests are added, stepped until every row has its first token (the prefill is done),
stepped a few more times (warm), then timed without the profiler and, separately, profiled. The step's
wall time comes from the unprofiled window; from the profiled one: the device-busy time per step (the union
of kernel and copy intervals) and the kernels launched per step. Host gap per step = wall - device busy:
the time the device waits for the host.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from typing import Any

import torch

# Substrings of the kernel names cuBLAS / CUTLASS GEMMs carry on Ampere and Hopper (lower-cased).
_GEMM_MARKS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "sm90_", "sm80_", "ampere_")
_ATTENTION_MARKS = ("paged_attention", "reduce_segments", "write_kv", "flash", "fmha")
_ids = itertools.count()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_kind(name: str) -> str:
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "copy"
    if any(mark in low for mark in _ATTENTION_MARKS):
        return "attention"
    if any(mark in low for mark in _GEMM_MARKS):
        return "gemm"
    return "other"


def compiled_variants() -> int | None:
    """Triton kernel variants compiled so far in this process by raytp's kernels (attention and layers), or None
    where Triton's cache layout is not the one read here (JITFunction.device_caches: device -> (cache, ...))."""
    try:
        from ops import triton_layers
        from ops.attention import triton_kernels

        total = 0
        for module in (triton_kernels, triton_layers):
            for obj in vars(module).values():
                caches = getattr(obj, "device_caches", None)
                if isinstance(caches, dict):
                    total += sum(len(entry[0]) for entry in caches.values())
        return total
    except Exception:  # noqa: BLE001 - a report field, never a failure
        return None


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Fresh prompts: a different seed shares no prefix-cache block with another seed's prompts."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def decode_steps(
    llm: Any, rows: int, prompt_len: int, vocab: int, seed: int, steps: int, num_layers: int, warm: int = 5
) -> dict[str, Any]:
    """`rows` sequences of `prompt_len` random tokens, decoding: ms per step, then a profiled window's device-busy
    ms per step, host gap, and kernels per step and per layer by kind (the requests are aborted after)."""
    from raytp import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=warm + 2 * steps + 16, ignore_eos=True)
    ids = [f"gpu-check-{next(_ids)}" for _ in range(rows)]
    for rid, prompt in zip(ids, random_prompts(rows, prompt_len, vocab, seed), strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    wanted = set(ids)
    while len(started) < rows:  # the prefill, chunked over steps
        started.update(d.request_id for d in engine.step() if d.request_id in wanted)
    for _ in range(warm):
        engine.step()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        synchronize()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = _union_us([(e.time_range.start, e.time_range.end) for e in device_events]) / steps / 1e3
    kinds = Counter(kernel_kind(e.name) for e in device_events)
    names = Counter(e.name[:80] for e in device_events if kernel_kind(e.name) in ("other", "attention"))
    non_gemm = kinds["other"] + kinds["attention"]
    kind_us: Counter[str] = Counter()
    kernel_us: Counter[str] = Counter()
    for e in device_events:
        kind_us[kernel_kind(e.name)] += e.time_range.elapsed_us()
        kernel_us[e.name[:80]] += e.time_range.elapsed_us()
    # The host side of the window: the Python-visible ops by self CPU time (what a host gap is made of).
    host_ops = sorted(
        (a for a in prof.key_averages() if a.device_type != torch.autograd.DeviceType.CUDA),
        key=lambda a: a.self_cpu_time_total,
        reverse=True,
    )[:12]
    return {
        "rows": rows,
        "context_at_start": prompt_len + warm,
        "step_ms": round(step_ms, 3),
        "device_busy_ms_per_step": round(busy_ms, 3),
        "device_busy_fraction": round(busy_ms / step_ms, 3) if step_ms else None,
        "host_gap_ms_per_step": round(step_ms - busy_ms, 3),
        "kernels_per_step": {k: round(v / steps, 1) for k, v in sorted(kinds.items())},
        "non_gemm_kernels_per_layer": round(non_gemm / steps / num_layers, 2),
        "top_non_gemm_kernels_per_step": {n: round(c / steps, 1) for n, c in names.most_common(12)},
        "device_us_per_step_by_kind": {k: round(v / steps, 1) for k, v in sorted(kind_us.items())},
        "top_kernels_us_per_step": {n: round(v / steps, 1) for n, v in kernel_us.most_common(12)},
        "top_host_ops_self_cpu_us_per_step": {a.key[:80]: round(a.self_cpu_time_total / steps, 1) for a in host_ops},
    }


def teacher_forced(
    ours: list[list[dict[int, Any] | None]], hf_logprobs: torch.Tensor, seqs: list[list[int]], first: int
) -> dict[str, Any]:
    """raytp's prompt_logprobs of `seqs` against HF's log-softmax over the same sequences ([B, L, V]; position
    j-1 predicts token j), at every position j >= first: top-1 agreement and |delta logprob| of seqs' token."""
    agree = total = 0
    deltas: list[float] = []
    for b, (entries, seq) in enumerate(zip(ours, seqs, strict=True)):
        hf_top1 = hf_logprobs[b].argmax(dim=-1).tolist()
        for j in range(max(first, 1), len(seq)):
            entry = entries[j]
            assert entry is not None, f"no prompt logprobs at position {j}"
            top1 = next(t for t, lp in entry.items() if lp.rank == 1)
            agree += int(top1 == hf_top1[j - 1])
            total += 1
            deltas.append(abs(entry[seq[j]].logprob - float(hf_logprobs[b, j - 1, seq[j]])))
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 4) if total else None,
        "max_abs_delta_logprob": round(max(deltas), 4) if deltas else None,
        "mean_abs_delta_logprob": round(sum(deltas) / len(deltas), 5) if deltas else None,
    }
