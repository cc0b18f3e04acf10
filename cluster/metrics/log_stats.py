"""The engine's periodic log lines, as vLLM V1 writes them (vllm/v1/metrics/loggers.py `LoggingStatLogger`,
vllm/v1/spec_decode/metrics.py `SpecDecodingLogging`):

    Engine smol: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 40.2 tokens/s, Running: 2 reqs,
        Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 33.0%
    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 25.10 tokens/s, Drafted throughput:
        44.00 tokens/s, Accepted: 251 tokens, Drafted: 440 tokens, Per-position acceptance rate: 0.800, 0.600,
        0.350, 0.200, Avg Draft acceptance rate: 57.0%

It is fed the same records the metrics recorder gets (`SchedulerStats`, `IterationStats`) and sums them over
the interval. Decisions: there is no timer; the owner calls `maybe_log` after each step and when the engine
goes idle, so a line is written at the first such call `interval_s` after the previous line, and its rates
divide by the time actually elapsed. The engine line is logged at DEBUG while the engine has been idle for two
intervals (vLLM's rule against log noise on an idle system); the spec line only for intervals with drafts.
Plain Python: no Ray, no torch.
"""

from __future__ import annotations

import logging
import time

from cluster.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


class StatsLogger:
    def __init__(
        self, name: str, num_speculative_tokens: int = 0, interval_s: float = LOG_INTERVAL_S, now: float | None = None
    ) -> None:
        """name: the engine's, in its line (the served model name). num_speculative_tokens: k (0: no spec line)."""
        self._name = name
        self._k = num_speculative_tokens
        self._interval_s = interval_s
        self._last_tokens = 0  # prompt + generation tokens in the previous interval (for the idle rule)
        self._scheduler: SchedulerStats | None = None  # the latest snapshot of the queues and the KV pool
        self._reset(time.monotonic() if now is None else now)

    def _reset(self, now: float) -> None:
        self._start = now
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        self._drafts = self._draft_tokens = self._accepted = 0
        self._accepted_per_pos = [0] * self._k

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self._scheduler = stats
        self._prefix_queries += stats.prefix_cache_queries
        self._prefix_hits += stats.prefix_cache_hits

    def observe_iteration(self, stats: IterationStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        spec = stats.spec_decoding
        if spec is not None:
            self._drafts += spec.num_drafts
            self._draft_tokens += spec.num_draft_tokens
            self._accepted += spec.num_accepted_tokens
            for i, n in enumerate(spec.num_accepted_tokens_per_pos):
                self._accepted_per_pos[i] += n

    def maybe_log(self, now: float | None = None) -> list[str]:
        """Write the lines if `interval_s` has passed since the previous ones (then start a new interval); returns
        what it wrote at INFO (empty: nothing due, or only the idle engine line at DEBUG)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        if elapsed < self._interval_s:
            return []
        engine = self._engine_line(elapsed)
        tokens = self._prompt_tokens + self._generation_tokens
        idle = tokens == 0 and self._last_tokens == 0
        lines = [] if idle else [engine]
        spec = self._spec_line(elapsed)
        if spec is not None:
            lines.append(spec)
        if idle:
            logger.debug("%s", engine)
        for line in lines:
            logger.info("%s", line)
        self._last_tokens = tokens
        self._reset(now)
        return lines

    def _engine_line(self, elapsed: float) -> str:
        s = self._scheduler
        running, waiting, usage = (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage) if s else (0, 0, 0.0)
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        return (
            f"Engine {self._name}: Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )

    def _spec_line(self, elapsed: float) -> str | None:
        """vLLM's SpecDecoding line. The mean acceptance length counts the target's own token after the accepted
        run (1 + accepted / drafts); a position's rate is its accepted proposals over all drafts, so a draft
        shorter than k counts as a rejection at the positions it did not reach, as in vLLM."""
        if not self._drafts:
            return None
        rates = ", ".join(f"{n / self._drafts:.3f}" for n in self._accepted_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {1 + self._accepted / self._drafts:.2f}, "
            f"Accepted throughput: {self._accepted / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {self._draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {self._accepted} tokens, Drafted: {self._draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {self._accepted / self._draft_tokens * 100:.1f}%"
        )
