"""The startup heap kept out of the cyclic garbage collector's way (vLLM's engine core does the same).

Decision, measured with the no-op model at 256 decode rows (`benchmarks/host_step.py`): after torch,
transformers and the model are loaded a process tracks ~400k container objects, and a full collection walks
all of them: 450-530 ms on the session's 2 shared cores, one every ~40 decode steps there, i.e. ~12 ms per
step on average (more than the step's own host work), as an occasional stall no median shows. `gc.freeze()`
moves what is alive at the end of start-up into the permanent generation, which collections never walk; it
is still freed by reference counting, and the cycles among it are collected again once `thaw_heap` (at
shutdown) hands it back. A `gc.collect()` first, so start-up's own garbage is not frozen with it.

Several engines (or workers) in one process, as in tests: each freezes what is alive when it is ready, and
the first to shut down (or, for an engine, to be dropped: the offline `LLM` has no shutdown) thaws all of it;
a later collection walks it again, so cycles among what was frozen are not kept past that.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every surviving object from later collections (until `thaw_heap`)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (their cycles become collectable again)."""
    gc.unfreeze()
