"""A simulated device: an executor whose step results arrive after a set delay, on the step thread.

The engine's host work (schedule, update, detokenize, stop checks) is real; the "device" holds no model and
answers every sampling row with a token after `device_s` of sleeping (the GIL is free meanwhile, as while a
GPU runs). With `gate`, step k's result is held until the host has begun scheduling step k + 1 (or
`gate_timeout_s` passed), so a test can tell whether the host plans ahead of the device without any timing.

    python -m benchmarks.sim_device [--rows 256] [--device-ms 10] [--steps 60]

prints the decode step's wall time for the synchronous and the asynchronous engine, interleaved over
rounds, beside the host's own time per step (device time 0) and the device time: the synchronous step
comes out near their sum, the asynchronous one near their maximum.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ResolvedEngineConfig
from cluster.engine import LLMEngine
from cluster.executor import Executor, check_rank_method
from model_exec.config import ModelConfig
from request.lora import LoRARequest
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, SeqSample


@dataclass
class StepGate:
    """Step k's result waits until schedule() was entered k + 1 times (or the timeout passed)."""

    timeout_s: float
    scheduled: int = 0  # schedule() calls begun
    overlapped: list[bool] = field(default_factory=list)  # per executed step: the next schedule began first
    cond: threading.Condition = field(default_factory=threading.Condition)

    def on_schedule(self) -> None:
        with self.cond:
            self.scheduled += 1
            self.cond.notify_all()

    def hold(self, step: int) -> None:
        with self.cond:
            self.overlapped.append(self.cond.wait_for(lambda: self.scheduled > step + 1, self.timeout_s))


class SimulatedDevice(Executor):
    def __init__(self, num_blocks: int, device_s: float, gate: StepGate | None = None, vocab: int = 256) -> None:
        self.num_blocks = num_blocks
        self.device_s = device_s
        self.gate = gate
        self.vocab = vocab
        self.steps = 0
        self.device_busy_s = 0.0

    def collective_rpc(
        self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """One simulated rank: the Worker method of that name is this object's (below)."""
        check_rank_method(method)
        return [getattr(self, method)(*args, **kwargs)]

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.num_blocks, 0

    def quantization(self) -> str:
        return "none"  # no weights at all

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step, self.steps = self.steps, self.steps + 1
        start = time.perf_counter()
        if self.device_s:
            time.sleep(self.device_s)
        if self.gate is not None:
            self.gate.hold(step)
        self.device_busy_s += time.perf_counter() - start
        out = ModelRunnerOutput()
        for seq_id, n in so.num_samples.items():
            # a byte-level token that depends on the sequence and the step only: never eos for ignore_eos rows
            tokens = [65 + (seq_id * 7 + step + k) % 26 for k in range(n)]
            out.samples[seq_id] = SeqSample(tokens, [-1.0] * n)
        return out

    def add_lora(self, lora: LoRARequest) -> None:
        raise NotImplementedError("the simulated device runs no adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    def list_loras(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    def start_metrics(self, model_name: str, replica: str) -> None:
        pass


def sim_engine(model: str, rows: int, device: SimulatedDevice, async_scheduling: bool, **kwargs: Any) -> LLMEngine:
    """An engine on `device`, its schedule() calls reported to the device's gate (if any)."""
    from cluster.config import EngineConfig

    def factory(config: ResolvedEngineConfig, model_config: ModelConfig) -> Executor:
        return device

    config = EngineConfig(
        model=model,
        max_num_seqs=rows,
        block_size=16,
        num_gpu_blocks_override=device.num_blocks,
        async_scheduling=async_scheduling,
        **kwargs,
    )
    engine = LLMEngine(config, executor_factory=factory)
    gate = device.gate
    if gate is not None:
        schedule = engine.schedule

        def reported() -> SchedulerOutput:
            gate.on_schedule()
            return schedule()

        engine.schedule = reported  # type: ignore[method-assign]
    return engine


def add_rows(engine: LLMEngine, rows: int, max_tokens: int, prompt_len: int = 16) -> None:
    from request.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"r{i}", [70 + (i + j) % 40 for j in range(prompt_len)], params)


def decode_step_wall(model: str, rows: int, device_s: float, async_scheduling: bool, steps: int) -> tuple[float, float]:
    """(median wall time of one decode step once every row decodes, the device's mean busy time per step:
    its sleep as the loaded machine gave it)."""
    device = SimulatedDevice(rows * 8, device_s)
    engine = sim_engine(model, rows, device, async_scheduling)
    add_rows(engine, rows, steps + 8)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.shutdown()
    return statistics.median(times[4:-4]), device.device_busy_s / max(device.steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--device-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from tests.helpers.tiny_models import make_tiny_llama  # the byte-tokenizer model: config and tokenizer only

    model = make_tiny_llama(tempfile.mkdtemp())
    dev = args.device_ms / 1000
    res: dict[str, list[tuple[float, float]]] = {"host": [], "sync": [], "async": []}
    for _ in range(args.rounds):  # interleaved rounds: a shared machine's noise hits every mode alike
        res["host"].append(decode_step_wall(model, args.rows, 0.0, False, args.steps))
        res["sync"].append(decode_step_wall(model, args.rows, dev, False, args.steps))
        res["async"].append(decode_step_wall(model, args.rows, dev, True, args.steps))
    host = statistics.median(w for w, _ in res["host"])
    print(f"{args.rows} rows, device {args.device_ms:.1f} ms asked, host {1000 * host:.2f} ms per step (medians)")
    for mode in ("sync", "async"):
        wall = statistics.median(w for w, _ in res[mode])
        busy = statistics.median(b for _, b in res[mode])
        print(
            f"  {mode:>5}: {1000 * wall:6.2f} ms/step, device busy {1000 * busy:.2f} ms/step; "
            f"/ (host + device) = {wall / (host + busy):.2f}; / max(host, device) = {wall / max(host, busy):.2f}"
        )


if __name__ == "__main__":
    main()
