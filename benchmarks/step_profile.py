"""Where one engine's time goes: wall time of an offline or single-stream run, optionally profiled.

    python -m benchmarks.step_profile --workload offline [--num-prompts 32] [--profile torch|cprofile]
    python -m benchmarks.step_profile --workload single [--input-len 128 --output-len 256]

`offline` is the throughput benchmark's mixed workload (random prompts 16-768, outputs 8-320,
ignore_eos, greedy), `single` one request at a time. Every timed run uses fresh random prompts,
so the prefix cache never flatters it. With `--profile torch` it prints torch.profiler's top ops
(self CPU time) and the share of step time per category (GEMM, attention, sampler, the rest);
with `--profile cprofile` the top Python functions by cumulative time. Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from cluster.engine import LLMEngine

_ids = itertools.count()

# torch.profiler op-name prefixes -> the category a step's time is charged to.
_CATEGORIES = (
    (
        "gemm",
        (
            "aten::addmm",
            "aten::mm",
            "aten::linear",
            "aten::matmul",
            "aten::bmm",
            "mkldnn::_linear",
            "raytp_cpu::panel_linear",
        ),
    ),
    (
        "attention",
        ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::index_select", "raytp_cpu::paged"),
    ),
    ("sampler", ("aten::log_softmax", "aten::_log_softmax", "aten::argmax", "aten::topk", "aten::sort")),
)


def make_workload(
    rng: random.Random, n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int
) -> list[tuple[list[int], int]]:
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


def run(
    engine: LLMEngine,
    work: list[tuple[list[int], int]],
    one_at_a_time: bool,
    on_step: Callable[[], None] = lambda: None,
) -> float:
    """Drive the engine's step loop as `LLM.generate` does; `on_step` runs after every step."""
    from raytp import SamplingParams

    def go(batch: list[tuple[list[int], int]]) -> None:
        for p, n in batch:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(str(next(_ids)), {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            engine.step()
            on_step()

    t0 = time.perf_counter()
    if one_at_a_time:
        for item in work:
            go([item])
    else:
        go(work)
    return time.perf_counter() - t0


def print_torch_profile(prof: torch.profiler.profile, wall_s: float) -> None:
    """Top ops by self time, and self time per category over `wall_s` (the profiled steps' wall time)."""
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        name = ev.key
        for cat, prefixes in _CATEGORIES:
            if name.startswith(prefixes):
                totals[cat] += ev.self_cpu_time_total / 1e6
                break
        else:
            totals["other ops"] += ev.self_cpu_time_total / 1e6
    ops_total = sum(totals.values())
    totals["python / outside ops"] = max(0.0, wall_s - ops_total)
    print(f"wall {wall_s:.2f} s; self time by category:")
    for cat, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:>22}: {sec:7.2f} s  {100 * sec / wall_s:5.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("offline", "single"), default="offline")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=None, help="offline: 32; single: 2")
    ap.add_argument("--input-len", type=int, nargs=2, default=None)
    ap.add_argument("--output-len", type=int, nargs=2, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--profile", choices=("none", "torch", "cprofile"), default="none")
    ap.add_argument("--sort", choices=("cumulative", "tottime"), default="cumulative", help="cprofile's order")
    ap.add_argument(
        "--profile-steps", type=int, nargs=2, default=(20, 60), help="torch profile: skip A steps, record B"
    )
    args = ap.parse_args()
    single = args.workload == "single"
    n = args.num_prompts or (2 if single else 32)
    in_range = tuple(args.input_len or ((128, 128) if single else (16, 768)))
    out_range = tuple(args.output_len or ((256, 256) if single else (8, 320)))

    from raytp import LLM

    engine = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
    ).llm_engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    run(engine, make_workload(rng, 2, (16, 64), (4, 8), vocab), one_at_a_time=False)  # warm-up
    work = make_workload(rng, n, in_range, out_range, vocab)
    prompt_tokens = sum(len(p) for p, _ in work)
    out_tokens = sum(m for _, m in work)

    if args.profile == "torch":
        # Only a window of steps is recorded: a whole offline run's events do not fit in memory.
        skip, active = args.profile_steps
        steps = itertools.count()
        window: list[float] = []
        schedule = torch.profiler.schedule(wait=skip, warmup=0, active=active, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:

            def on_step() -> None:
                i = next(steps)
                if i in (skip - 1, skip + active - 1):
                    window.append(time.perf_counter())
                prof.step()

            wall = run(engine, work, single, on_step)
        print_torch_profile(prof, window[1] - window[0] if len(window) == 2 else wall)
    elif args.profile == "cprofile":
        pr = cProfile.Profile()
        pr.enable()
        wall = run(engine, work, single)
        pr.disable()
        pstats.Stats(pr).sort_stats(args.sort).print_stats(40)
    else:
        wall = run(engine, work, single)
    print(
        f"{args.workload}: {n} requests, {prompt_tokens} prompt + {out_tokens} output tokens, "
        f"threads {torch.get_num_threads()}: {wall:.2f} s, {(prompt_tokens + out_tokens) / wall:.1f} total tok/s"
        + (f", {1000 * wall / out_tokens:.1f} ms/output token" if single else "")
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
