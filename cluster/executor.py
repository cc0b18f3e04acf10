"""Executors: how the engine reaches its workers.

`InProcessExecutor` holds one `Worker` in the engine's own process (TP=1, the offline default).
`cluster.ray_executor.RayExecutor` runs one worker actor per TP rank in a placement group and
implements the same interface; `cluster.engine.make_executor` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from cluster.config import ResolvedEngineConfig
from cluster.worker import Worker
from model_exec.config import ModelConfig
from scheduler.lora import LoRARequest
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU blocks) every rank can hold: the minimum over ranks."""

    @abstractmethod
    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return rank 0's output."""

    @abstractmethod
    def add_lora(self, lora: LoRARequest) -> None:
        """Load the adapter on every rank (keyed by its lora_int_id). A LoRAError raised on a rank reaches the
        caller as itself, and no rank keeps the adapter; any other failure is the rank's (the engine's end)."""

    @abstractmethod
    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop the adapter from every rank; False when the ranks did not hold it."""

    @abstractmethod
    def list_loras(self) -> list[int]:
        """The adapter ids the ranks hold."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def check_health(self) -> None:  # noqa: B027 - optional hook: in-process workers have nothing to check
        """Raise if any rank is unusable."""

    @abstractmethod
    def start_metrics(self, model_name: str, replica: str) -> None:
        """Every rank records its step time from now on (`cluster.metrics.WorkerMetrics`), under these labels."""


class InProcessExecutor(Executor):
    def __init__(self, config: ResolvedEngineConfig, model_config: ModelConfig) -> None:
        self.worker = Worker(config, model_config)
        self.worker.load_model()

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_cpu_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(so)
        assert out is not None  # rank 0 always answers
        return out

    def start_metrics(self, model_name: str, replica: str) -> None:
        self.worker.start_metrics(model_name, replica)

    def add_lora(self, lora: LoRARequest) -> None:
        self.worker.add_lora(lora)  # the worker leaves its state unchanged when it raises

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.worker.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.worker.list_loras()

    def shutdown(self) -> None:
        self.worker.shutdown()
