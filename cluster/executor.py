"""Executors: how the engine reaches its workers.

The interface is vLLM's: `execute_model` (one step, the hot path), `collective_rpc` (every other per-rank
operation, by the name of a `cluster.worker.Worker` method), `check_health` and `shutdown`. A per-rank
operation is written once, in `Worker`; the executors carry it without restating it, so a new one (or a new
executor) is one method, not one per hop.

`InProcessExecutor` holds one `Worker` in the engine's own process (TP=1, the offline default).
`cluster.ray_executor.RayExecutor` runs one worker actor per TP rank in a placement group and
implements the same interface; `cluster.engine.make_executor` picks one.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from cluster.async_step import StepHandle, Submit
from cluster.config import ResolvedEngineConfig
from cluster.worker import Worker
from model_exec.config import ModelConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return rank 0's output."""

    @abstractmethod
    def collective_rpc(
        self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on `ranks` (default: every rank) and return their answers in
        rank order. A `RequestError` a rank raises (e.g. a `LoRAError`: the caller's input, not the rank, is at
        fault) reaches the caller as itself once every rank answered, and the executor stays usable; any other
        failure, or no answer within `timeout_s` (default: the step deadline), is the rank's: the executor is
        unusable afterwards."""

    def step_launcher(self) -> Submit | None:
        """How the asynchronous step starts a step in place, from the host thread (cluster/async_step.py);
        None: on a step thread, through `execute_model`."""
        return None

    def check_health(self) -> None:  # noqa: B027 - optional hook: in-process workers have nothing to check
        """Raise if any rank is unusable."""

    @abstractmethod
    def shutdown(self) -> None: ...


def check_rank_method(method: str) -> None:
    """Refuse a name that is not one of Worker's public methods (a typo would otherwise fail on a rank)."""
    if method.startswith("_") or not callable(getattr(Worker, method, None)):
        raise AttributeError(f"collective_rpc: Worker has no public method {method!r}.")


class InProcessExecutor(Executor):
    """launch_in_place: the asynchronous step launches each step from the host thread and resolves it there
    (`step_launcher`; model_exec/step_launch.py). None: on a CUDA device, where it keeps the GIL to the host's
    own thread while the device runs; True on the CPU runs the same split with nothing to overlap (tests)."""

    def __init__(
        self,
        config: ResolvedEngineConfig,
        model_config: ModelConfig,
        launch_in_place: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        self.worker = Worker(config, model_config, num_threads=num_threads)
        self.worker.load_model()
        self.launch_in_place = config.device == "cuda" if launch_in_place is None else launch_in_place
        # Waits for launched steps' readback events (one torch call, the GIL released while it waits), so the
        # pipeline's caller can wait on a future, blocking or from an event loop. Never runs a step.
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None

    def step_launcher(self) -> Submit | None:
        return self.launch_model if self.launch_in_place else None

    def launch_model(self, so: SchedulerOutput) -> StepHandle:
        """Enqueue the step (returns once it is on the device); the handle resolves it on the caller's thread."""
        launched = self.worker.launch_model(so)
        if launched.done():
            ready: concurrent.futures.Future[None] = concurrent.futures.Future()
            ready.set_result(None)
        else:
            if self._waiter is None:
                self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytp-event")
            ready = self._waiter.submit(launched.wait)
        return StepHandle(ready, launched.resolve)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(so)
        assert out is not None  # rank 0 always answers
        return out

    def collective_rpc(
        self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        check_rank_method(method)
        if ranks is not None and list(ranks) != [0]:
            raise ValueError(f"collective_rpc: the in-process executor has rank 0 only, not {list(ranks)}.")
        # A RequestError leaves the worker's state unchanged (each Worker method's contract): it passes as is.
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
        self.worker.shutdown()
