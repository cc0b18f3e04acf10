"""The asynchronous engine step (vLLM's `async_scheduling`): the host plans step N+1 while step N runs.

One step of the pipeline, in order:

1. if the step in flight (N) cannot be planned past (below), wait for it and apply its result;
2. schedule step N+1 and launch it (the executor's queue runs it after N, on the workers);
3. wait for N's result and apply it: samples in place of their placeholders, stops, detokenizing, deltas;
   this is the host work that runs beside the device's step N+1;
4. count N+1's tokens as computed and give every sequence it samples a placeholder token, so the next
   schedule() plans N+2 past it.

Invariants that make the outputs equal to the synchronous step's:
- At most one step is unresolved when the scheduler plans, and every placeholder is the newest token of its
  sequence. A worker fills it with the token it sampled itself (ModelRunner.last_sampled), so the model
  reads the same ids; the scheduler puts the real token in its place when the result arrives (step 3), before
  the output processor or a stop check ever reads the sequence.
- A sequence that stops at N is known one step late: it already runs in N+1, whose sample for it is dropped
  (`Scheduler.apply_result` skips ended sequences) and never shown; its blocks were freed when it stopped and
  the workers forget it at the next step, so nothing leaks. Its N+1 row writes the KV of its last real token
  only, into a block it still owned when N+1 was scheduled; the device runs steps in order, so a block handed
  on afterwards is written by its new owner later.
- A sequence that N's sample surely ends by length gets no placeholder, so it is not scheduled again.
- Planned past only when N has no fork (`best_of`/`n` sample their first tokens), no row under a grammar
  (its next mask needs the token) and no prompt logprobs (collected in order, reset on preemption): then the
  pipeline waits for N first, as the synchronous step does. Structured-output rows so cost the overlap of the
  steps they sample in, and nothing else.

Two ways to run the steps, both behind `submit`, which returns a `StepHandle`:
- on a step thread (`StepHandle.of_future`): the worker call runs whole there, the Ray executor's and any
  executor's road;
- launched in place (the in-process executor on CUDA, `Executor.step_launcher`): `submit` enqueues the step on
  the device from the host thread itself and returns at once; the handle's `ready` completes when the step's
  results are on the host, and `result` builds its output on the host thread (model_exec/step_launch.py). No
  step thread shares the GIL with the host's scheduling and output processing.

Torch-free, like the engine: the workers and their tensors sit behind `submit`. The pipeline drives its engine
through `StepHost`, the few phases it calls, so this module sits below `cluster.engine` (which builds it) and
never imports it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.outputs import RequestDelta
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import SequenceGroup


@dataclass
class StepHandle:
    """A started step: `ready` completes when `result()` no longer waits for the workers; `result` gives the
    step's output (raising the step's failure), on the caller's thread."""

    ready: concurrent.futures.Future[Any]
    result: Callable[[], ModelRunnerOutput]

    @staticmethod
    def of_future(future: concurrent.futures.Future[ModelRunnerOutput]) -> StepHandle:
        """A step run whole on another thread (or process): its future is both."""
        return StepHandle(future, future.result)

    @staticmethod
    def failed(error: BaseException) -> StepHandle:
        future: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        future.set_exception(error)
        return StepHandle.of_future(future)


Submit = Callable[[SchedulerOutput], StepHandle]


@dataclass
class InFlight:
    """A launched step: its schedule, the scheduler's plan of it, and its result to come."""

    so: SchedulerOutput
    items: list[Any]  # Scheduler.take_scheduled(): the (group, seq, tokens) plan apply_result needs
    handle: StepHandle
    plan_past: bool  # the next step may be scheduled before this one's samples are known

    @property
    def future(self) -> concurrent.futures.Future[Any]:
        """Completes when the step's result is ready to be applied without waiting."""
        return self.handle.ready


def can_plan_past(so: SchedulerOutput) -> bool:
    """Whether the step after `so` can be scheduled before `so`'s samples are known (see the module note)."""
    return not so.structured_seq_ids and not so.prompt_logprobs_seq_ids and all(n == 1 for n in so.num_samples.values())


class StepHost(Protocol):
    """The engine phases the pipeline runs (cluster.engine.LLMEngine provides them), all on the host thread."""

    scheduler: Scheduler
    dead: BaseException | None  # set by `fail`: then nothing more is launched

    def schedule(self) -> SchedulerOutput: ...

    def emit(self, groups: list[SequenceGroup]) -> list[RequestDelta]: ...

    def collect_finished(self) -> list[RequestDelta]: ...

    def fail(self, error: BaseException) -> None: ...


class StepPipeline:
    """The engine's asynchronous step. `submit` starts a step on the workers and returns its handle; the
    steps it starts run in submission order (one worker thread, Ray actors' ordered queues, or one device
    stream)."""

    def __init__(self, engine: StepHost, submit: Submit) -> None:
        self.engine = engine
        self.submit = submit
        self.in_flight: InFlight | None = None
        self.last_resolved: SchedulerOutput | None = None  # the schedule of the step last applied (metrics)

    def step(self) -> Generator[concurrent.futures.Future[ModelRunnerOutput], None, list[RequestDelta]]:
        """One pipeline step; yields each future it must wait for (the caller waits, blocking or awaiting)
        and returns the deltas of the step it applied, if any."""
        deltas: list[RequestDelta] = []
        self.last_resolved = None
        current = self.in_flight
        if current is not None and not current.plan_past:
            yield current.future
            deltas += self._apply(current)
            current = None
        launched = self._launch()
        if current is not None:
            yield current.future
            deltas += self._apply(current)
        self.in_flight = launched
        if launched is not None and self.engine.dead is None:
            sched = self.engine.scheduler
            sched.advance_computed(launched.items)
            if launched.plan_past:
                sched.add_placeholders(launched.items, launched.so)
        return deltas + self.engine.collect_finished()

    def run_blocking(self) -> list[RequestDelta]:
        """`step`, waiting on this thread (the offline engine's `LLMEngine.step`)."""
        gen = self.step()
        try:
            while True:
                concurrent.futures.wait([next(gen)])
        except StopIteration as stop:
            return stop.value
        except Exception as e:
            self.engine.fail(e)  # every request in flight ends with the error; the caller sees it raised
            raise

    def wait_idle(self) -> None:
        """Block until no step runs on the workers (its result is kept for the next step to apply): other
        worker calls (LoRA loads) never run beside a step."""
        if self.in_flight is not None:
            concurrent.futures.wait([self.in_flight.future])

    def _launch(self) -> InFlight | None:
        engine = self.engine
        if engine.dead is not None:
            return None
        so = engine.schedule()
        items = engine.scheduler.take_scheduled()
        if so.is_empty:  # nothing to run (then nothing was planned either)
            return None
        try:
            handle = self.submit(so)
        except Exception as e:  # the executor refused at once (a dead actor, a failed launch): as a failed step
            handle = StepHandle.failed(e)
        return InFlight(so, items, handle, can_plan_past(so))

    def _apply(self, step: InFlight) -> list[RequestDelta]:
        engine = self.engine
        try:
            result = step.handle.result()
        except Exception:
            self.in_flight = None  # the caller fails the engine: every request in flight ends with the error
            raise
        self.last_resolved = step.so
        groups = engine.scheduler.apply_result(step.items, result)
        return engine.emit(groups)
