"""What recording metrics costs the engine loop: microseconds per engine step, in a Ray actor.

    python benchmarks/metrics_overhead.py [--steps 2000] [--batch 32]

Each step records one SchedulerStats and one IterationStats for a batch of `--batch` decoding
requests (one ITL observation each), with one request finishing every 8 steps: the shape of a
busy decode loop. Prints the median per-step cost over 5 rounds, in the actor that records (as
the controller will), next to Ray's export interval for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats  # noqa: E402


@ray.remote(num_cpus=0)
class Bench:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32, help="decoding requests per step")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        bench = Bench.remote()  # type: ignore[attr-defined]
        ray.get(bench.run.remote(200, args.batch))  # warm up: instruments created, thread started
        rounds = [ray.get(bench.run.remote(args.steps, args.batch)) for _ in range(5)]
    finally:
        ray.shutdown()
    per_step_us = statistics.median(rounds) * 1e6
    print(f"batch={args.batch} steps={args.steps}: {per_step_us:.1f} us per engine step recording metrics (median)")
    print(f"  = {per_step_us / 20_000 * 100:.2f}% of a 20 ms decode step, {per_step_us / 100_000 * 100:.2f}% of 100 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
