"""The per-forward LoRA context: which packed tokens run with which adapter in this step.

The model runner builds one `StepLoRA` per step (once, from its rows) and sets it on the rank's `LoRAContext`
for the duration of the forward; every LoRA-capable linear layer of that rank holds a reference to the same
`LoRAContext` and reads the step from it. So no model's forward signature carries LoRA, and every family
that builds its projections from `layers/linear.py` gets adapters.

Invariant: `LoRAContext.step` is set only inside `LoRAContext.use(...)` (through `LoRAManager.batch`; it
refuses nesting) and is None otherwise; a forward outside `use` (the profile step, CUDA graph capture) runs the
base model. One context per rank (per model instance), never a module global: the threads that simulate TP
ranks in tests each hold their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLoRA:
    """One step's tokens grouped by adapter: for each adapter present, the [start, stop) ranges of packed
    token positions that run with it. Tokens in no range (rows of the base model) skip LoRA."""

    groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (lora_int_id, token ranges), ids distinct

    @staticmethod
    def from_rows(row_lora_ids: list[int], starts: list[int]) -> StepLoRA | None:
        """From each row's adapter id (0: none) and the rows' packed token offsets (len = rows + 1); None when
        no row has an adapter. Adjacent rows of one adapter merge into one range, so rows sorted by adapter
        (as the runner orders them within decodes and within prefills) give at most two ranges per adapter."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for i, lora_id in enumerate(row_lora_ids):
            if lora_id == 0:
                continue
            mine = ranges.setdefault(lora_id, [])
            if mine and mine[-1][1] == starts[i]:
                mine[-1] = (mine[-1][0], starts[i + 1])
            else:
                mine.append((starts[i], starts[i + 1]))
        if not ranges:
            return None
        return StepLoRA(tuple((lora_id, tuple(r)) for lora_id, r in ranges.items()))

    @property
    def lora_ids(self) -> list[int]:
        return [lora_id for lora_id, _ in self.groups]


class LoRAContext:
    """Holds the running step's `StepLoRA` for one rank's LoRA layers (see the module's invariant).

    A forward holds the context's lock from start to end, and adapters are committed to or dropped from the
    layers only under it (`between_steps`), so a forward never sees an adapter half-replaced, even when the
    controller adds one from another thread (the in-process executor's event loop) while a step runs.
    """

    def __init__(self) -> None:
        self.step: StepLoRA | None = None
        self._lock = threading.Lock()
        self._running = False

    @contextmanager
    def use(self, build: Callable[[], StepLoRA | None]) -> Iterator[StepLoRA | None]:
        """Runs a forward under the step `build()` returns; built under the lock, so the adapters it checks
        are the ones the forward reads."""
        if self._running:
            raise RuntimeError("a forward is already running on this rank's LoRA context (forwards do not nest)")
        with self._lock:
            step = build()
            self._running, self.step = True, step
            try:
                yield step
            finally:
                self._running, self.step = False, None

    @contextmanager
    def between_steps(self) -> Iterator[None]:
        """Waits for a running forward to end and keeps the next one out while the block runs."""
        with self._lock:
            yield
