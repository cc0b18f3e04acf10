"""The asynchronous step overlaps the host with the device, shown without any timing: on a simulated device
(benchmarks/sim_device.py) step k's result is held until the host has begun scheduling step k + 1. With 256
rows the asynchronous engine plans every step while the previous one is still on the device; the synchronous
engine never does (each of its steps waits out the gate's timeout). The wall-time figure is the benchmark's:
`python -m benchmarks.sim_device`."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from benchmarks.sim_device import SimulatedDevice, StepGate, add_rows, sim_engine
from cluster.async_step import can_plan_past
from scheduler.outputs import SchedulerOutput
from tests.helpers.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def model() -> str:
    return make_tiny_llama(tempfile.mkdtemp())


def run(model: str, rows: int, async_scheduling: bool, timeout_s: float, max_tokens: int) -> tuple[StepGate, list[Any]]:
    gate = StepGate(timeout_s)
    device = SimulatedDevice(rows * 4, 0.0, gate)
    engine = sim_engine(model, rows, device, async_scheduling)
    add_rows(engine, rows, max_tokens)
    deltas: list[Any] = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    bm = engine.block_manager
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"
    engine.shutdown()
    return gate, deltas


def text_by_request(deltas: list[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for d in deltas:
        out[d.request_id] = out.get(d.request_id, "") + "".join(s.text for s in d.samples)
    return out


def test_256_rows_host_plans_each_step_while_the_device_runs(model: str) -> None:
    gate, deltas = run(model, 256, True, timeout_s=30.0, max_tokens=6)
    # 256 x 16 prompt tokens over chunked-prefill steps (2048 tokens each, decodes first), then the decodes
    assert len(gate.overlapped) >= 7 and all(gate.overlapped), gate.overlapped
    _, sync_deltas = run(model, 256, False, timeout_s=0.05, max_tokens=6)
    assert text_by_request(deltas) == text_by_request(sync_deltas)


def test_the_sync_engine_never_overlaps(model: str) -> None:
    gate, _ = run(model, 8, False, timeout_s=0.05, max_tokens=3)
    assert gate.overlapped and not any(gate.overlapped)


def test_steps_that_fork_sample_under_a_grammar_or_score_the_prompt_are_waited_for() -> None:
    assert can_plan_past(SchedulerOutput(num_samples={1: 1, 2: 1}))
    assert not can_plan_past(SchedulerOutput(num_samples={1: 1, 2: 3}))
    assert not can_plan_past(SchedulerOutput(num_samples={1: 1}, structured_seq_ids=[1]))
    assert not can_plan_past(SchedulerOutput(num_samples={1: 1}, prompt_logprobs_seq_ids=[1]))
