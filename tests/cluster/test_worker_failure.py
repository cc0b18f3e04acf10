"""A rank that dies or stalls mid-generation fails every request in flight, fast, and names the rank.

Afterwards the failed engine refuses work, its placement group and surviving rank are gone, and a
new engine / controller serves correctly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.controller import EngineController
from cluster.outputs import RequestDelta
from cluster.ray_executor import RankFailedError, RayExecutor
from raytp import LLM, EngineConfig, EngineDeadError
from tests.cluster.ray_helpers import (
    assert_nothing_left,
    generate_ids,
    greedy,
    live_placement_groups,
    rank_actor,
    ray_session,  # noqa: F401  (module fixture)
    tiny_prompts,
    wait_until,
)
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.usefixtures("ray_session")

CONFIG = dict(kv_cache_memory_bytes=1 << 24)
LONG = 450  # tokens per request: generation outlasts the kill by far (prompts <= 59 tokens, max_model_len 512)
FAIL_WITHIN_S = 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama(Path(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    return generate_ids(LLM(model, **CONFIG), tiny_prompts(4), 16)


def _generate_in_background(llm: LLM) -> tuple[threading.Thread, dict[str, BaseException]]:
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            generate_ids(llm, tiny_prompts(4), LONG)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    engine = llm.llm_engine
    wait_until(lambda: any(g.seqs[0].output_token_ids for g in list(engine.scheduler.running)), 60, "first tokens")
    return thread, outcome


def _check_recovery(model: str, reference: list[list[int]], pgs_before: set[str]) -> None:
    assert_nothing_left(pgs_before)
    fresh = LLM(model, tensor_parallel_size=2, **CONFIG)
    try:
        assert generate_ids(fresh, tiny_prompts(4), 16) == reference
    finally:
        fresh.llm_engine.shutdown()


def test_killed_rank_fails_llm_generate(model: str, reference: list[list[int]]) -> None:
    before = live_placement_groups()
    llm = LLM(model, tensor_parallel_size=2, **CONFIG)
    executor = llm.llm_engine.executor
    assert isinstance(executor, RayExecutor)
    thread, outcome = _generate_in_background(llm)
    ray.kill(rank_actor(f"{executor.name}-rank1"))
    thread.join(FAIL_WITHIN_S)
    assert not thread.is_alive(), f"LLM.generate still running {FAIL_WITHIN_S} s after a rank died"
    error = outcome.get("error")
    assert isinstance(error, RankFailedError) and error.rank == 1, error
    assert "tensor-parallel rank 1 of 2" in str(error) and "died" in str(error)
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate("more")
    _check_recovery(model, reference, before)


def test_stalled_rank_times_out(model: str, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank frozen mid-step (SIGSTOP) stalls the collective: the step deadline fails it, naming that rank."""
    monkeypatch.setenv("RAYTP_STEP_TIMEOUT_S", "3")
    before = live_placement_groups()
    llm = LLM(model, tensor_parallel_size=2, **CONFIG)
    executor = llm.llm_engine.executor
    assert isinstance(executor, RayExecutor)
    pid = executor.nodes[1].pid
    thread, outcome = _generate_in_background(llm)
    os.kill(pid, signal.SIGSTOP)
    try:
        thread.join(FAIL_WITHIN_S)
        assert not thread.is_alive(), "a stalled rank hung LLM.generate"
        error = outcome.get("error")
        assert isinstance(error, RankFailedError) and error.rank == 1, error
        assert "did not finish the step within 3 s (unresponsive" in str(error)
    finally:
        with contextlib.suppress(ProcessLookupError):  # in case Ray's kill has not landed yet
            os.kill(pid, signal.SIGKILL)
    _check_recovery(model, reference, before)


def test_killed_rank_fails_controller_streams(model: str, reference: list[list[int]]) -> None:
    before = live_placement_groups()
    controller = EngineController.remote(EngineConfig(model=model, tensor_parallel_size=2, **CONFIG))
    ray.get(controller.model_info.remote())  # started: the rank actors exist

    async def run() -> tuple[list[RequestDelta], float]:
        gens = [
            controller.generate.options(num_returns="streaming").remote(f"r{i}", p, greedy(LONG))
            for i, p in enumerate(tiny_prompts(3))
        ]
        for g in gens:
            await (await g.__anext__())  # every request is in flight
        killed = time.monotonic()
        ray.kill(rank_actor("-rank0"))

        async def last(gen: Any) -> RequestDelta:
            return [await ref async for ref in gen][-1]

        finals = await asyncio.wait_for(asyncio.gather(*(last(g) for g in gens)), FAIL_WITHIN_S)
        return finals, time.monotonic() - killed

    finals, elapsed = asyncio.run(run())
    assert elapsed < FAIL_WITHIN_S
    for final in finals:
        assert final.finished and final.error is not None and "tensor-parallel rank 0 of 2" in final.error
        assert final.samples and final.samples[-1].finish_reason == "abort"
    with pytest.raises(Exception, match="the engine is dead"):
        ray.get(controller.check_health.remote())
    ray.get(controller.shutdown.remote())
    ray.kill(controller)

    assert_nothing_left(before)
    fresh = EngineController.remote(EngineConfig(model=model, tensor_parallel_size=2, **CONFIG))

    async def serve() -> list[list[int]]:
        async def tokens(i: int, prompt: list[int]) -> list[int]:
            gen = fresh.generate.options(num_returns="streaming").remote(f"new-{i}", prompt, greedy(16))
            return [t for d in [await ref async for ref in gen] for s in d.samples for t in s.token_ids]

        return await asyncio.gather(*(tokens(i, p) for i, p in enumerate(tiny_prompts(4))))

    try:
        assert asyncio.run(serve()) == reference
        ray.get(fresh.check_health.remote())
    finally:
        ray.get(fresh.shutdown.remote())
        ray.kill(fresh)
