"""raytp/pooling.py's order: prompts enter the engine longest first (little padding per step, as
sentence-transformers batches), while ids and results keep the caller's order."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from cluster.outputs import RequestDelta
from raytp.pooling import run_pooling
from request.pooling_params import PoolingParams


class RecordingEngine:
    """Answers each request with its own prompt's size, one request per step, in the order they were added."""

    def __init__(self, refuse: str | None = None) -> None:
        self.added: list[tuple[str, Any]] = []  # queued, not yet answered
        self.order: list[Any] = []  # every prompt, in the order it was added
        self.aborted: list[str] = []
        self.refuse = refuse

    def add_request(self, rid: str, prompt: Any, params: PoolingParams) -> None:
        if prompt == self.refuse:
            raise ValueError("refused")
        self.added.append((rid, prompt))
        self.order.append(prompt)

    def abort_request(self, rids: list[str]) -> None:
        self.aborted.extend(rids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.added)

    def step(self) -> list[RequestDelta]:
        rid, prompt = self.added.pop(0)
        return [RequestDelta(rid, finished=True, pooled=prompt)]


def test_longest_first_into_the_engine_results_in_input_order() -> None:
    prompts: list[Any] = ["bb", "a", {"prompt_token_ids": [1, 2, 3, 4]}, "ccc", [5, 6, 7, 8, 9]]
    engine = RecordingEngine()
    out = run_pooling(engine, prompts, PoolingParams(task="embed"), itertools.count(7), use_tqdm=False)  # type: ignore[arg-type]
    assert engine.order == [[5, 6, 7, 8, 9], {"prompt_token_ids": [1, 2, 3, 4]}, "ccc", "bb", "a"]
    assert [rid for rid, _, _ in out] == ["7", "8", "9", "10", "11"]  # ids follow the input
    assert [pooled for _, pooled, _ in out] == prompts


def test_a_refused_prompt_aborts_what_the_call_queued() -> None:
    engine = RecordingEngine(refuse="bb")
    with pytest.raises(ValueError, match="refused"):
        run_pooling(engine, ["a", "bb", "cccc"], PoolingParams(task="embed"), itertools.count(), use_tqdm=False)  # type: ignore[arg-type]
    assert engine.aborted == ["2"]  # "cccc" went in first; "bb" was refused; "a" never went in
