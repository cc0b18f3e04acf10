"""Host time per engine step with the model replaced by a no-op: what the device would wait for.

    python -m benchmarks.host_step [--rows 64 256] [--model M] [--steps 40] [--rounds 3]

Runs `rows` requests (16-token prompts, greedy, ignore_eos) through the real in-process engine and worker,
with the model's forward returning nothing to compute (a [T, 1] zero hidden state) and its logits taken
from a fixed random bank (so tokens vary and the detokenizer does real work). Every decode step's wall time
is then host work only: scheduling, the worker's input preparation, sampling, the scheduler's update, the
output processor. Prints the median per row count (and the mean, stalls included) and the worker's share
(its `execute`). Works on any tree whose engine has `LLMEngine.step` and an in-process worker
(`executor.worker.shard.runner`), so the same script measures a base commit (PYTHONPATH=that tree) for
before/after figures. Rounds alternate row counts; on a shared machine compare medians of interleaved runs
only. To measure another tree with this
script, run it by path with PYTHONPATH=that tree. (Decision: wall time only. The engine thread's CPU time,
`time.thread_time`, ticks in 4 ms steps on the session machine and came out above the wall time.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch


class NoopModel:
    """Stands in for a CausalLM: no forward work; logits from a fixed bank of random rows."""

    def __init__(self, vocab: int, max_rows: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.bank = torch.randn(max_rows, vocab, generator=gen)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        reps = -(-n // self.bank.shape[0])
        return (self.bank if reps == 1 else self.bank.repeat(reps, 1))[:n]


def measure(model: str | None, rows: int, steps: int) -> tuple[float, float, float]:
    """(median decode step wall, mean decode step wall, median worker execute time), in seconds. The mean
    shows what the median hides: an occasional stall (a full garbage collection walking the whole heap was
    ~0.5 s once every ~40 steps at 256 rows before cluster/heap.py)."""
    from raytp import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=rows, num_gpu_blocks_override=rows * 4, block_size=16, max_num_batched_tokens=4096)
    engine = llm.llm_engine
    runner = engine.executor.worker.shard.runner
    runner.model = NoopModel(engine.model_config.vocab_size, 64)
    worker_times: list[float] = []
    execute = runner.execute

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            worker_times.append(time.perf_counter() - t0)

    runner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(rows):
        engine.add_request(
            f"r{i}", {"prompt_token_ids": [(i * 31 + j * 7) % (vocab - 200) + 100 for j in range(16)]}, params
        )
    walls: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    engine.shutdown()
    # the decode steps: past the prefill (one step at this budget) and the first decodes, before the tail
    decode = walls[3:-3]
    return statistics.median(decode), statistics.fmean(decode), statistics.median(worker_times[3:-3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--model", default=None, help="default: the tiny byte-vocabulary Llama of the tests")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.helpers.tiny_models import make_tiny_llama

        model = make_tiny_llama(tempfile.mkdtemp())
    res: dict[int, list[tuple[float, float, float]]] = {r: [] for r in args.rows}
    for _ in range(args.rounds):
        for rows in args.rows:
            res[rows].append(measure(model, rows, args.steps))
    for rows in args.rows:
        wall = statistics.median(w for w, _, _ in res[rows])
        mean = statistics.median(m for _, m, _ in res[rows])
        worker = statistics.median(w for _, _, w in res[rows])
        print(
            f"{rows:4d} decode rows: {1000 * wall:6.2f} ms host per step (mean {1000 * mean:6.2f}), "
            f"of which the worker {1000 * worker:5.2f} ms"
        )


if __name__ == "__main__":
    main()
