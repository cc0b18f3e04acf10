"""Per-step cost of the Ray executor vs the in-process one, and the bytes each rank receives per step.

At TP=1 the two paths run the same model on the same engine; the difference in ms/step is what
Ray adds (pickling the SchedulerOutput, one actor call, the result coming back). Measured on
steady decode steps: `--batch` requests are prefilled and warmed up first, then `--steps` pure
decode steps are timed; bytes/step is the pickled SchedulerOutput (what each rank receives).
All engines are built first and then measured in interleaved rounds (`--rounds`), each figure the
median over rounds: on a shared 2-core machine, measuring one path after the other lets a noisy
minute land on one side only (seen here: the same in-process case at 56 and 74 ms/step).

    python -m benchmarks.ray_overhead                 # tiny random Llama (overhead-dominated), ~1 min
    python -m benchmarks.ray_overhead --model smollm2 # the embedded SmolLM2-135M, ~3 min on 2 cores
    python -m benchmarks.ray_overhead --tp 2          # also time the Ray path at TP=2

The default tiny model (2 layers, hidden 64) makes a forward pass cost almost nothing, so the
Ray overhead shows at its largest relative size; SmolLM2 shows it against a real model.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

PROMPT_LEN = 32
RAY_WORKER_NICENESS = 15  # Ray's default `worker_niceness`


@dataclass
class Figures:
    ms_per_step: float  # median over timed decode steps
    bytes_per_step: float  # mean pickled SchedulerOutput size over the timed steps


def measure(llm: Any, batch: int, steps: int, seed: int) -> Figures:
    from raytp import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)], params)
    for _ in range(4):  # prefill (one step at these sizes) and warm-up decodes
        engine.step()
    assert len(engine.scheduler.running) == batch and not engine.scheduler.waiting, "not in steady decode"

    sizes: list[int] = []
    real_execute = engine.executor.execute_model

    def execute_and_measure(so: Any) -> Any:
        sizes.append(len(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)))
        return real_execute(so)

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.executor.execute_model = execute_and_measure  # sizes from extra, untimed steps of the same shape
    for _ in range(8):
        engine.step()
    engine.executor.execute_model = real_execute
    engine.abort_request(ids)
    engine.step()  # tells the workers to drop the aborted sequences
    return Figures(statistics.median(times) * 1e3, statistics.mean(sizes))


def prefill_bytes(batch: int) -> int:
    """Pickled size of a step that admits `batch` new PROMPT_LEN-token requests (they travel in full)."""
    from request.sampling_params import SamplingParams
    from scheduler.outputs import NewSeqData, SchedulerOutput

    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    so = SchedulerOutput(
        new_seqs=[
            NewSeqData(
                i, list(range(1000, 1000 + PROMPT_LEN)), PROMPT_LEN, [2 * i, 2 * i + 1], 0, PROMPT_LEN, params, i, 0
            )
            for i in range(batch)
        ],
        num_samples={i: 1 for i in range(batch)},
    )
    return len(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random Llama), 'smollm2', or a model path")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=0, help="timed decode steps per case (0: 100 tiny, 30 else)")
    parser.add_argument("--tp", type=int, default=1, help="also time the Ray path at this TP size (>1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, in-process and in Ray")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (median reported)")
    args = parser.parse_args()

    import os

    import torch

    # Same compute on both paths: the in-process worker and each Ray rank run `--threads` torch threads, at
    # the same CPU priority (Ray starts its workers at niceness 15; on a shared machine an un-niced driver
    # would win every contended time slice and make the Ray path look slower than it is).
    torch.set_num_threads(args.threads)
    os.environ["RAYTP_CPUS_PER_WORKER"] = str(args.threads)
    os.nice(max(0, RAY_WORKER_NICENESS - os.nice(0)))

    import ray

    from raytp import LLM

    model: str | None = args.model
    if args.model == "tiny":
        from tests.helpers.tiny_models import make_tiny_llama

        model = make_tiny_llama(tempfile.mkdtemp(prefix="raytp-bench-"))
    elif args.model == "smollm2":
        model = None
    steps = args.steps or (100 if args.model == "tiny" else 30)
    # Every engine stays up for the interleaved rounds: the TP=1 rank and, with --tp, the TP ranks hold CPUs at once.
    ranks = 1 + (args.tp if args.tp > 1 else 0)
    ray.init(address="local", num_cpus=max(2, ranks) * args.threads, include_dashboard=False, log_to_driver=False)
    common = dict(kv_cache_memory_bytes=1 << 28, max_num_seqs=max(args.batch), enable_prefix_caching=False)

    cases: list[tuple[str, dict[str, Any]]] = [
        ("in-process TP=1", dict(distributed_executor_backend="inprocess")),
        ("Ray        TP=1", dict(distributed_executor_backend="ray")),
    ]
    if args.tp > 1:
        cases.append((f"Ray        TP={args.tp}", dict(tensor_parallel_size=args.tp)))
    llms = {name: LLM(model, **common, **extra) for name, extra in cases}
    rounds: dict[str, dict[int, list[Figures]]] = {name: {b: [] for b in args.batch} for name in llms}
    for r in range(args.rounds):
        for b in args.batch:
            for name, llm in llms.items():
                rounds[name][b].append(measure(llm, b, steps, seed=1000 * r + b))
    for llm in llms.values():
        llm.llm_engine.shutdown()
    ray.shutdown()
    results = {
        name: {
            b: Figures(
                statistics.median(f.ms_per_step for f in figs), statistics.median(f.bytes_per_step for f in figs)
            )
            for b, figs in per_batch.items()
        }
        for name, per_batch in rounds.items()
    }

    print(f"\nmodel: {'tiny random Llama (2 layers, hidden 64)' if args.model == 'tiny' else args.model}; "
          f"{steps} timed decode steps per case and round, median ms/step over {args.rounds} interleaved rounds; "
          f"prompts of {PROMPT_LEN} tokens; {args.threads} torch thread(s) per rank")  # fmt: skip
    print(f"{'executor':<18}" + "".join(f"{f'batch {b} ms/step':>20}" for b in args.batch))
    for name, figs in results.items():
        print(f"{name:<18}" + "".join(f"{figs[b].ms_per_step:>20.2f}" for b in args.batch))
    base, ray1 = results["in-process TP=1"], results["Ray        TP=1"]
    print(
        f"{'Ray overhead TP=1':<18}"
        + "".join(f"{ray1[b].ms_per_step - base[b].ms_per_step:>+20.2f}" for b in args.batch)
    )
    print("\nbytes sent to each rank per step (pickled SchedulerOutput):")
    for b in args.batch:
        decode, prefill = ray1[b].bytes_per_step, prefill_bytes(b)
        print(f"  decode batch {b:>3}: {decode:>8.0f} B   prefill of {b:>3} new requests: {prefill:>8} B")


if __name__ == "__main__":
    main()
