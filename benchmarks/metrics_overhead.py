"""What recording metrics costs the engine loop, measured on the real engine, in a Ray actor.

    python benchmarks/metrics_overhead.py [--batch 32] [--steps 64] [--model PATH]
    python benchmarks/metrics_overhead.py --recorder-only [--batch 32] [--steps 2000]

Default: an actor (as the controller is) builds the real engine (the embedded SmolLM2 unless
--model, in process) and the controller's `EngineTelemetry`, admits `--batch` requests that decode
`--steps` tokens each, and steps it exactly as the controller does: schedule, execute, update,
then `EngineTelemetry.on_publish` (stats from the deltas + Ray recording; the worker records its
step time inside execute). It prints the median wall time of an engine step and of the recording
that follows it, over the decode steps, and their ratio: the share of each step spent on metrics.

--recorder-only: the recorder's cost alone (EngineMetrics fed with synthetic stats records for a
batch of `--batch` decoding requests, one finishing every 8 steps), no model needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats  # noqa: E402


@ray.remote(num_cpus=0)
class EngineBench:
    def __init__(self, model: str | None, batch: int, steps: int) -> None:
        from cluster.config import EngineConfig
        from cluster.engine import LLMEngine
        from cluster.engine_telemetry import EngineTelemetry

        config = EngineConfig(model=model, max_model_len=512, max_num_seqs=max(batch, 1),
                              distributed_executor_backend="inprocess")  # fmt: skip
        self.engine = LLMEngine(config)
        self.telemetry = EngineTelemetry(self.engine, "bench-replica", "bench-model")
        self.batch, self.steps = batch, steps
        self.round = 0

    def run(self) -> dict[str, list[float]]:
        """One round: `batch` fresh requests decoded to the end; per decode step, (step s, recording s)."""
        from request.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=self.steps, ignore_eos=True, temperature=0.8, seed=0)
        self.round += 1
        for i in range(self.batch):
            rid = f"r{self.round}-{i}"
            prompt = [100 + (self.round * 131 + i * 17 + j) % 9000 for j in range(32)]  # no prefix shared
            group = self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            self.telemetry.on_add(rid, params, group.arrival_time)
        step_s, record_s = [], []
        while self.engine.has_unfinished_requests():
            start = time.monotonic()
            so = self.engine.schedule()
            deltas = self.engine.update(so, self.engine.execute(so))
            mid = time.monotonic()
            self.telemetry.on_publish(deltas, so, start)
            end = time.monotonic()
            if not so.new_seqs:  # decode steps only: the steady state of a busy server
                step_s.append(mid - start)
                record_s.append(end - mid)
        return {"step": step_s, "record": record_s}


@ray.remote(num_cpus=0)
class RecorderBench:
    def __init__(self) -> None:
        from cluster.metrics.ray_metrics import EngineMetrics

        self.metrics = EngineMetrics("bench-model", "bench-replica", num_ranks=1)

    def run(self, steps: int, batch: int) -> float:
        """Seconds per step spent recording."""
        finished = FinishedRequestStats("stop", 2.0, 100, 50, 64, 1, 0.01, 0.1, 1.9)
        sched = SchedulerStats(batch, 3, 0, 0.4, prefix_cache_queries=16, prefix_cache_hits=8)
        start = time.perf_counter()
        for i in range(steps):
            it = IterationStats(
                num_prompt_tokens=100 if i % 8 == 0 else 0,
                num_generation_tokens=batch,
                num_scheduled_tokens=batch,
                time_to_first_tokens=[0.05] if i % 8 == 0 else [],
                inter_token_latencies=[0.02] * batch,
                finished_requests=[finished] if i % 8 == 0 else [],
                step_time=0.02,
            )
            self.metrics.record_scheduler_stats(sched)
            self.metrics.record_iteration_stats(it)
        return (time.perf_counter() - start) / steps


def _engine(args: argparse.Namespace) -> None:
    bench: Any = EngineBench.remote(args.model, args.batch, args.steps)  # type: ignore[attr-defined]
    ray.get(bench.run.remote())  # warm up: instruments created, kernels touched
    step, record = [], []
    for _ in range(args.rounds):
        r = ray.get(bench.run.remote())
        step += r["step"]
        record += r["record"]
    step_ms, record_us = statistics.median(step) * 1e3, statistics.median(record) * 1e6
    share = statistics.median(r / s for r, s in zip(record, step, strict=True)) * 100
    print(f"batch={args.batch}, {len(step)} decode steps over {args.rounds} rounds (medians):")
    print(f"  engine step (schedule + execute + update): {step_ms:.2f} ms")
    print(f"  metrics recording after it (EngineTelemetry.on_publish): {record_us:.1f} us")
    print(f"  = {share:.2f}% of an engine step")


def _recorder(args: argparse.Namespace) -> None:
    bench: Any = RecorderBench.remote()  # type: ignore[attr-defined]
    ray.get(bench.run.remote(200, args.batch))  # warm up: instruments created, thread started
    rounds = [ray.get(bench.run.remote(args.steps, args.batch)) for _ in range(5)]
    per_step_us = statistics.median(rounds) * 1e6
    print(f"batch={args.batch} steps={args.steps}: {per_step_us:.1f} us per engine step recording metrics (median)")
    print(f"  = {per_step_us / 20_000 * 100:.2f}% of a 20 ms decode step, {per_step_us / 100_000 * 100:.2f}% of 100 ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recorder-only", action="store_true", help="synthetic stats, no engine")
    parser.add_argument("--model", default=None, help="model of the engine (default: the embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=32, help="decoding requests per step")
    parser.add_argument("--steps", type=int, default=None, help="tokens per request (default 64), or recorder steps")
    parser.add_argument("--rounds", type=int, default=3, help="engine rounds after a warm-up one")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 2000 if args.recorder_only else 64
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        (_recorder if args.recorder_only else _engine)(args)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
