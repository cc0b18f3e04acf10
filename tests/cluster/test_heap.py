"""The engine freezes the startup heap (cluster/heap.py) and gives it back: nothing frozen outlives it.

A reference cycle alive when the engine becomes ready is frozen with everything else; once it becomes garbage
it must still be collected after the engine shuts down, or is dropped without a shutdown (the offline LLM).
"""

from __future__ import annotations

import gc
import tempfile
import weakref
from collections.abc import Callable

import pytest

from raytp import LLM
from tests.helpers.tiny_models import make_tiny_llama


class _Node:
    """One object in a reference cycle with itself (only the cyclic collector frees it)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(scope="module")
def model() -> str:
    return make_tiny_llama(tempfile.mkdtemp())


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.shutdown()


def _drop(llm: LLM) -> None:
    """Nothing: the caller's `del` drops the last reference."""


@pytest.mark.parametrize("release", [_shutdown, _drop], ids=["shutdown", "dropped"])
def test_frozen_cycle_is_collected_after_the_engine(model: str, release: Callable[[LLM], None]) -> None:
    node = _Node()
    ref = weakref.ref(node)
    llm = LLM(model, max_num_seqs=4, num_gpu_blocks_override=16, block_size=16)
    assert gc.get_freeze_count() > 0, "the ready engine froze its startup heap"
    del node
    gc.collect()
    assert ref() is not None, "a frozen object is left alone by collections while the engine runs"
    release(llm)
    del llm
    gc.collect()
    assert ref() is None, "the cycle frozen at start-up was never collected"
    assert gc.get_freeze_count() == 0
